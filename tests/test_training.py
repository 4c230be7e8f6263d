"""Prompt tuning through a real swarm on 127.0.0.1: the loss and the prompts' gradients through 2- and 3-server
chains equal local autograd on the transformers model (float32), shallow and deep, in micro-batches and compressed;
a server killed between the forward and the backward is replaced; the servers' kept forwards are bounded. Bad
backwards are fuzzed in tests/test_rpc_fuzz.py."""

import contextlib
import time

import pytest
import torch
from transformers import StoppingCriteriaList

from bloombee.protocol import InvalidStep
from bloombee.server.memory import SessionRefused
from bloombee.server.training import KeptForward, KeptForwards
from swarm_support import KillServerAt, client, reference, save_tiny_llama, serving

SERVERS = {"a": "0:4", "b": "4:8", "c": "0:3", "d": "3:6", "spare": "3:6", "spare2": "3:6", "e": "6:8"}
CHAIN_WITH_SPARES = ["c", "d", "spare", "spare2", "e"]  # each test that kills a middle server leaves one to replace it
CHAINS = {2: ["a", "b"], 3: ["c", "d", "e"]}
PREFIX = 3
IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79], [0, 0, 26, 53, 58, 97, 93, 23],
                    [84, 62, 64, 33, 83, 27, 95, 2], [0, 88, 41, 97, 16, 93, 99, 37]])
MASK = (torch.arange(8)[None] >= torch.tensor([[0], [2], [0], [1]])).long()
# a token right after padding is not scored: its logits come from a padding position, whose output is undefined
LABELS = torch.where(MASK.bool() & torch.nn.functional.pad(MASK, (1, -1), value=1).bool(), IDS, -100)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model"))
    with serving(folder, tmp_path_factory, SERVERS, "--dtype", "float32") as swarm:
        yield swarm


@pytest.fixture(scope="module")
def ref(swarm):
    return reference(swarm.model)


@contextlib.contextmanager
def deep_prompts_added(ref, deep: torch.Tensor | None):
    """While inside, each block of the transformers model `ref` adds its deep prompt ([prefix, H], or [rows, prefix,
    H]) to the prefix positions' hidden states before it computes."""
    def add_prompt(prompt):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = hidden + torch.nn.functional.pad(prompt, (0, 0, 0, hidden.shape[1] - PREFIX))
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
        return hook
    hooks = [] if deep is None else [layer.register_forward_pre_hook(add_prompt(prompt), with_kwargs=True)
                                     for prompt, layer in zip(deep, ref.model.layers)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def local_logits(ref, ids: torch.Tensor, mask: torch.Tensor, shallow: torch.Tensor,
                 deep: torch.Tensor | None) -> torch.Tensor:
    """The transformers model's logits of the real tokens after the same prompts (rotary positions counting real
    tokens only, as its generate() counts them and the servers do)."""
    embeds = torch.cat([shallow.expand(len(ids), -1, -1), ref.get_input_embeddings()(ids)], dim=1)
    mask = torch.cat([torch.ones(len(ids), PREFIX, dtype=mask.dtype), mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with deep_prompts_added(ref, deep):
        return ref(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits[:, PREFIX:].contiguous()


def local_loss(ref, shallow: torch.Tensor, deep: torch.Tensor | None) -> torch.Tensor:
    logits = local_logits(ref, IDS, MASK, shallow, deep)
    return ref.loss_function(logits=logits, labels=LABELS, vocab_size=ref.config.vocab_size)


def local_gradients(ref, tuning) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Local autograd's gradients of the loss for copies of `tuning`'s prompts."""
    shallow = tuning.shallow.detach().clone().requires_grad_()
    deep = tuning.deep.detach().clone().requires_grad_() if tuning.deep is not None else None
    local_loss(ref, shallow, deep).backward()
    return shallow.grad, deep.grad if deep is not None else None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("chain, mode, micro_batches, compression", [
    (2, "ptune", 1, "off"), (3, "deep_ptune", 1, "off"), (2, "deep_ptune", 2, "on"), (3, "ptune", 2, "on")])
def test_loss_and_gradients_equal_local_autograd(swarm, ref, chain, mode, micro_batches, compression):
    with client(swarm, tuning_mode=mode, pre_seq_len=PREFIX, allowed_servers=CHAINS[chain],
                micro_batches=micro_batches, compression=compression) as model:
        tuning = model.prompt_tuning
        if tuning.deep is not None:
            torch.nn.init.normal_(tuning.deep, std=0.1)
        loss = model(IDS, attention_mask=MASK, labels=LABELS).loss
        loss.backward()
        with torch.no_grad():
            assert abs(float(loss) - float(local_loss(ref, tuning.shallow, tuning.deep))) < 1e-4
        shallow, deep = local_gradients(ref, tuning)
        assert relative_error(tuning.shallow.grad, shallow) < 1e-3
        if deep is not None:
            assert relative_error(tuning.deep.grad, deep) < 1e-3
            assert bool((tuning.deep.grad != 0).any(-1).any(-1).all())  # every block's prompt got a gradient


def test_a_server_killed_before_the_backward_is_replaced(swarm, ref):
    with client(swarm, tuning_mode="deep_ptune", pre_seq_len=PREFIX, allowed_servers=CHAIN_WITH_SPARES) as model:
        tuning = model.prompt_tuning
        torch.nn.init.normal_(tuning.deep, std=0.1)
        chains = []
        original = model.remote.manager.make_route
        model.remote.manager.make_route = lambda *args: chains.append(original(*args)) or chains[-1]
        loss = model(IDS, attention_mask=MASK, labels=LABELS).loss
        victim = chains[0][1].record.public_name
        swarm.kill(victim)
        loss.backward()
        assert len(chains[-1]) == 1 and chains[-1][0].record.public_name in set(CHAIN_WITH_SPARES[1:4]) - {victim}
    shallow, deep = local_gradients(ref, tuning)
    assert relative_error(tuning.shallow.grad, shallow) < 1e-3
    assert relative_error(tuning.deep.grad, deep) < 1e-3


def test_deep_prompts_survive_a_server_killed_mid_generation(swarm, ref):
    """The replacement server's session opens with its blocks' deep prompts: the replay gives the same tokens."""
    with client(swarm, tuning_mode="deep_ptune", pre_seq_len=PREFIX, allowed_servers=CHAIN_WITH_SPARES) as model:
        torch.nn.init.normal_(model.prompt_tuning.deep, std=0.5)
        killer = KillServerAt(swarm, model, span_index=1, after=4, prompt_length=IDS.shape[1])
        with model.inference_session(max_length=32) as session:
            out = model.generate(IDS[:1], max_new_tokens=10, do_sample=False,
                                 stopping_criteria=StoppingCriteriaList([killer]))
            assert killer.killed is not None and session.recoveries >= 1
        ids = IDS[:1]
        with torch.no_grad():
            for _ in range(10):
                logits = local_logits(ref, ids, torch.ones_like(ids), model.prompt_tuning.shallow, model.prompt_tuning.deep)
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ids)


@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
def test_a_tuned_model_generates_what_the_local_model_does_with_its_prompts(swarm, ref, mode):
    with client(swarm, tuning_mode=mode, pre_seq_len=PREFIX, allowed_servers=CHAINS[2]) as model:
        tuning = model.prompt_tuning
        if tuning.deep is not None:
            torch.nn.init.normal_(tuning.deep, std=0.5)
        out = model.generate(IDS[:1], max_new_tokens=8, do_sample=False)
        ids = IDS[:1]
        with torch.no_grad():
            for _ in range(8):
                logits = local_logits(ref, ids, torch.ones_like(ids), tuning.shallow, tuning.deep)
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ids)


def test_kept_forwards_are_bounded_in_bytes_and_forgotten_after_their_timeout():
    kept = KeptForwards(max_bytes=1024, timeout_s=0.2)
    kept.keep("a", KeptForward("peer", 0, 4, torch.zeros(1, 2, 64), None, None, None))  # 512 bytes
    with pytest.raises(SessionRefused, match="kept-forward-bytes 1024"):
        kept.keep("b", KeptForward("peer", 0, 4, torch.zeros(1, 3, 64), None, None, None))
    with pytest.raises(InvalidStep, match="is kept already"):
        kept.keep("a", KeptForward("peer", 0, 4, torch.zeros(1, 1, 64), None, None, None))
    with pytest.raises(InvalidStep, match="another peer"):
        kept.find("a", "someone else")
    assert kept.find("a", "peer").hidden.shape == (1, 2, 64)
    time.sleep(0.3)
    with pytest.raises(InvalidStep, match="waited over 0.2 s"):
        kept.find("a", "peer")
    assert kept.nbytes == 0
