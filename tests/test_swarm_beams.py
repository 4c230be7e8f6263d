"""Beam search (and sampled num_return_sequences) through a real swarm: the servers reorder their cache rows by the
hypotheses the client derives from generate()'s ids, token for token equal to transformers' beam search, also with
micro-batches and across a server killed mid-generation; a reorder that does not fit the session is refused."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteriaList

from bloombee.client import AutoDistributedModel
from bloombee.client.spans import RequestRejected
from bloombee.loading import resolve_model
from swarm_support import KillServerAt, serving

MODEL = "bloombee-tiny"
PROMPTS = ["def fibonacci(n):", "import os\nimport"]
BEAMS, NEW_TOKENS = 4, 12


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with serving(MODEL, tmp_path_factory, {"a": "0:4", "b": "4:8", "c": "4:8"}, "--dtype", "float32") as swarm:
        yield swarm


@pytest.fixture(scope="module")
def inputs():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    tokenizer.padding_side = "left"
    return tokenizer(PROMPTS, return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def expected(inputs):
    local = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float32).eval()
    return local.generate(**inputs, num_beams=BEAMS, max_new_tokens=NEW_TOKENS, do_sample=False)


def open_model(swarm, **settings):
    return AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers, dtype=torch.float32,
                                                **settings)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_beam_search_equals_transformers(swarm, inputs, expected, micro_batches):
    with open_model(swarm, micro_batches=micro_batches) as model:
        out = model.generate(**inputs, num_beams=BEAMS, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, expected)


def test_beam_search_survives_a_server_killed_mid_generation(swarm, inputs, expected):
    with open_model(swarm) as model:
        killer = KillServerAt(swarm, model, span_index=1, after=5, prompt_length=inputs.input_ids.shape[1])
        with model.inference_session(max_length=64, batch_size=len(PROMPTS) * BEAMS) as session:
            out = model.generate(**inputs, num_beams=BEAMS, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 stopping_criteria=StoppingCriteriaList([killer]))
            assert killer.killed in ("b", "c") and session.recoveries >= 1 and session.rows_version > 0
    assert torch.equal(out, expected)


def test_sampled_return_sequences_get_their_own_rows(swarm, inputs):
    with open_model(swarm, draft_model="none") as model:
        out = model.generate(**inputs, do_sample=True, num_return_sequences=3, max_new_tokens=4)
    assert out.shape[0] == len(PROMPTS) * 3


def test_a_reorder_that_does_not_fit_is_refused(swarm, inputs):
    with open_model(swarm) as model, model.inference_session(max_length=32, batch_size=2) as session:
        session.step(model.head.embed(inputs.input_ids))
        with pytest.raises(ValueError, match="a reorder names one row of the session's 2 per row"):
            session.reorder(torch.tensor([0, 1, 1]))
        session.reorder(torch.tensor([1, 1]))
        session._pending_rows = torch.tensor([0, 5])  # past the client's check: the servers refuse it
        with pytest.raises(RequestRejected, match="reorder names rows outside the session's 2"):
            session.step(model.head.embed(inputs.input_ids[:, :1]))
