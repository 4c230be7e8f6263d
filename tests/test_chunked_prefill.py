"""Long prompts through servers with a small --max-chunk-tokens: they travel and compute as chunks, exact against
transformers, also across a server killed mid-generation; a step over the limit is refused by name and the server
goes on serving."""

import pytest
import torch
from transformers import StoppingCriteriaList

from bloombee.client.loop import run_sync
from bloombee.client.spans import RequestRejected
from swarm_support import KillServerAt, client, reference, save_tiny_llama, serving

MAX_CHUNK_TOKENS = 16
ROWS, PROMPT_TOKENS, NEW_TOKENS = 3, 41, 8  # 41 = 8 chunks of 16 // 3 = 5 positions, and one
PROMPTS = torch.randint(3, 120, (ROWS, PROMPT_TOKENS), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model") / "chunk-llama")
    with serving(folder, tmp_path_factory, {"a": "0:4", "b": "4:8", "c": "4:8"}, "--dtype", "float32",
                 "--max-chunk-tokens", str(MAX_CHUNK_TOKENS)) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def expected(swarm):
    return reference(swarm.model).generate(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False)


def test_a_long_prompt_goes_as_chunks_and_equals_transformers(swarm, expected):
    with client(swarm) as model, model.inference_session(max_length=64, batch_size=ROWS) as session:
        out = model.generate(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False)
        prompt_steps = [shape for shape in session.history.shapes if shape.start < PROMPT_TOKENS]
    assert torch.equal(out, expected)
    per_step = MAX_CHUNK_TOKENS // ROWS
    assert [shape.tokens for shape in prompt_steps] == [per_step] * (PROMPT_TOKENS // per_step) + [PROMPT_TOKENS % per_step]


def test_chunks_are_replayed_exactly_onto_a_replacement(swarm, expected):
    with client(swarm, allowed_servers=["a", "b", "c"]) as model:
        killer = KillServerAt(swarm, model, span_index=1, after=3, prompt_length=PROMPT_TOKENS)
        with model.inference_session(max_length=64, batch_size=ROWS) as session:
            out = model.generate(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 stopping_criteria=StoppingCriteriaList([killer]))
            assert killer.killed in ("b", "c") and session.recoveries >= 1
    assert torch.equal(out, expected)


def test_a_step_over_the_limit_is_refused_by_name_and_the_server_goes_on(swarm, expected):
    with client(swarm, allowed_servers=["a", "b", "c"]) as model:
        with model.inference_session(max_length=64, batch_size=ROWS) as session:
            hidden = torch.randn(ROWS, MAX_CHUNK_TOKENS, model.config.hidden_size)
            with pytest.raises(RequestRejected, match=f"a step of {ROWS} rows x {MAX_CHUNK_TOKENS} tokens is over "
                                                      f"this server's --max-chunk-tokens {MAX_CHUNK_TOKENS}"):
                run_sync(session._linear_step(hidden, torch.ones(ROWS, MAX_CHUNK_TOKENS, dtype=torch.bool), 0))
        out = model.generate(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, expected)
