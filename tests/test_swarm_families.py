"""Families other than llama through a real 3-server swarm on 127.0.0.1: greedy tokens equal the local transformers
model's, for a single prompt longer-lived than any sliding window, a left-padded batch in micro-batches with
compression, and across a server killed mid-generation."""

from functools import partial

import pytest
import torch
from transformers import StoppingCriteriaList

from conftest import make_tiny_model, make_tiny_multimodal_gemma3
from swarm_support import NUM_BLOCKS, KillServerAt, client, reference, serving

FAMILIES = {  # tiny variant -> the servers' extra flags
    "qwen2-sliding": (),
    "gemma": ("--offload", "0.5"),
    "qwen3-moe": (),
    "phi3": (),
    "gemma2": (),
    "gemma3": (),
    "bloom": ("--offload", "0.5"),  # ALiBi slopes of the heads in host memory
    "gpt-oss": ("--offload", "0.5"),  # attention sinks of the heads in host memory
    "deepseek-v3": ("--offload", "0.5"),  # the latent cache (one head) in host memory
    "gemma3-multimodal": (),  # its text model served; the reference is the whole multimodal model
}
BUILDERS = {"gemma3-multimodal": make_tiny_multimodal_gemma3}
SERVERS = {"a": "0:3", "b": "3:6", "spare": "3:6", "c": "6:8"}
PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35]])
NEW_TOKENS = 24  # past the sliding windows of qwen2-sliding, gemma2, gemma3, gpt-oss (6 slots) and phi3 (8)


@pytest.fixture(scope="module", params=list(FAMILIES))
def swarm(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / request.param
    build = BUILDERS.get(request.param, partial(make_tiny_model, request.param))
    build(num_layers=NUM_BLOCKS, seed=2).save_pretrained(folder)
    with serving(folder, tmp_path_factory, SERVERS, "--dtype", "float32", *FAMILIES[request.param]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def ref(swarm):
    return reference(swarm.model)


def test_greedy_tokens_equal_the_local_model(swarm, ref):
    with client(swarm) as model:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, ref.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False))


def test_a_left_padded_batch_in_micro_batches_with_compression_equals_the_local_model(swarm, ref):
    ids = torch.tensor([[0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6], [0, 11, 12, 13, 14, 15], [0, 0, 21, 22, 23, 24]])
    mask = (torch.arange(6)[None] >= torch.tensor([[3], [0], [1], [2]])).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    with client(swarm, micro_batches=2, compression="on") as model:
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref.generate(ids, **kwargs))


def test_a_server_killed_mid_generation_is_replaced_exactly(swarm, ref):
    with client(swarm) as model:
        killer = KillServerAt(swarm, model, span_index=1, after=6, prompt_length=PROMPT.shape[1])
        with model.inference_session(max_length=64) as session:
            out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 stopping_criteria=StoppingCriteriaList([killer]))
            assert killer.killed is not None and session.recoveries >= 1
    assert torch.equal(out, ref.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False))
