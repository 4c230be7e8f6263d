"""LoRA adapters served by real servers on 127.0.0.1 (`--adapters`, peft's format): a session's greedy tokens equal
the peft-merged local model's for the adapter it picks, and the base model's without one; only servers holding the
adapter are routed to; a server asked for an adapter it does not hold refuses by name."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from bloombee.client import RequestRejected
from bloombee.client.loop import run_sync
from bloombee.client.routing import MissingBlocksError
from bloombee.client.stateless import forward_span
from bloombee.codec import CompressionPolicy
from conftest import make_tiny_model
from swarm_support import NUM_BLOCKS, client, reference, save_tiny_llama, serving

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35]])
NEW_TOKENS = 12
TARGETS = {"attention": ["q_proj", "v_proj"], "everywhere": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]}


def save_adapter(folder, targets: list[str], seed: int) -> str:
    """A LoRA adapter of the tiny Llama with random (non-zero) weights, saved as peft saves it."""
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    get_peft_model(make_tiny_model("llama-gqa", num_layers=NUM_BLOCKS, seed=1), config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return {name: save_adapter(tmp_path_factory.mktemp(name), targets, seed)
            for seed, (name, targets) in enumerate(TARGETS.items())}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, adapters):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model"))
    with_adapters = ("--adapters", *adapters.values())
    servers = {"a": "0:4", "b": "4:8"}
    with serving(folder, tmp_path_factory, servers, "--dtype", "float32", *with_adapters) as swarm:
        swarm.add_server("--blocks", "0:8", "--dtype", "float32", name="plain")
        yield swarm


def merged(swarm, adapter: str):
    return PeftModel.from_pretrained(reference(swarm.model), adapter).merge_and_unload().eval()


def greedy(model) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_session_computes_the_adapter_it_picks(swarm, adapters, name):
    with client(swarm, active_adapter=adapters[name]) as model:
        out, route = greedy(model), model.remote.manager.make_route(0, NUM_BLOCKS)
    assert [span.record.public_name for span in route] == ["a", "b"]
    assert torch.equal(out, greedy(merged(swarm, adapters[name])))
    assert not torch.equal(out, greedy(reference(swarm.model)))


def test_without_an_adapter_the_base_model_is_computed_also_by_servers_holding_adapters(swarm):
    with client(swarm, allowed_servers=["a", "b"]) as model:
        out = greedy(model)
    assert torch.equal(out, greedy(reference(swarm.model)))


def test_a_stateless_forward_computes_the_adapter(swarm, adapters):
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with client(swarm, active_adapter=adapters["everywhere"]) as model:
        logits = model(ids).logits
    assert torch.allclose(logits, merged(swarm, adapters["everywhere"])(ids).logits, atol=1e-4)


def test_an_adapter_no_server_holds_is_not_routed_to_and_is_refused_by_name(swarm):
    with client(swarm, active_adapter="someone/else") as model:
        with pytest.raises(MissingBlocksError):
            model.remote.manager.make_route(0, NUM_BLOCKS)
    with client(swarm) as model:
        span = next(span for span in model.remote.manager.make_route(0, NUM_BLOCKS))
        with pytest.raises(RequestRejected, match="does not hold adapter 'someone/else'"):
            run_sync(forward_span(model.remote.p2p, span, torch.zeros(1, 2, model.config.hidden_size), None,
                                  CompressionPolicy("off"), 30.0, adapter="someone/else"))
        assert model(PROMPT).logits.shape[1] == PROMPT.shape[1]  # the server still serves
