"""KV offload: a cache split by KV heads between the device and host memory gives the results of an unsplit one."""

from __future__ import annotations

import pytest
import torch

from bloombee.loading import load_block_stack, load_client_head
from bloombee.models.core import masks
from bloombee.models.core.offload import OffloadedKVCache, host_kv_heads

pytestmark = pytest.mark.usefixtures("single_thread_torch")

OFFLOADS = (0.25, 0.5, 1.0)
FOUR_KV_HEADS = dict(num_attention_heads=8, num_key_value_heads=4)  # alpha 0.25 is one KV head


def run(stack, head, ids, padding, offload, prompt):
    """Hidden states of a left-padded batch: the prompt in one step, then one token per step."""
    batch, total = ids.shape
    caches = stack.new_caches(batch, total, offload=offload)
    rope = masks.rope_positions_from_padding(padding)
    outputs = []
    for lo, hi in [(0, prompt)] + [(i, i + 1) for i in range(prompt, total)]:
        positions = torch.arange(lo, hi)
        mask = masks.causal_mask(positions, hi, padding[:, :hi])
        outputs.append(stack(head.embed(ids[:, lo:hi]), rope[:, lo:hi], caches, positions, mask))
    return torch.cat(outputs, dim=1), caches


def greedy(stack, head, ids, steps, offload):
    batch, prompt = ids.shape
    caches = stack.new_caches(batch, prompt + steps, offload=offload)
    tokens, new, positions = ids, [], torch.arange(prompt)
    for _ in range(steps):
        length = int(positions[-1]) + 1
        mask = masks.causal_mask(positions, length, batch_size=batch)
        hidden = stack(head.embed(tokens), positions.expand(batch, -1), caches, positions, mask)
        tokens = head.logits(hidden[:, -1]).argmax(-1)[:, None]
        new.append(tokens)
        positions = torch.tensor([length])
    return torch.cat(new, dim=1)


@pytest.mark.parametrize("variant", ["llama", "mixtral", "bloom", "gpt-oss", "deepseek-v3"])  # by head: slopes, sinks
def test_offloaded_caches_give_the_same_hidden_states_and_tokens(variant, tiny_checkpoint):
    folder, _ = tiny_checkpoint(variant, **FOUR_KV_HEADS)
    stack, head = load_block_stack(folder, 0, 4), load_client_head(folder)
    torch.manual_seed(3)
    ids = torch.randint(1, 128, (3, 20))
    padding = torch.ones(3, 20, dtype=torch.bool)
    padding[1, :4] = False  # a left-padded row
    with torch.no_grad():
        reference, _ = run(stack, head, ids, padding, 0.0, prompt=12)
        reference_tokens = greedy(stack, head, ids[:, :6], 24, 0.0)
        for offload in OFFLOADS:
            hidden, caches = run(stack, head, ids, padding, offload, prompt=12)
            assert all(isinstance(cache, OffloadedKVCache) for cache in caches)
            assert (hidden - reference).abs().max() <= 1e-5, offload
            assert torch.equal(greedy(stack, head, ids[:, :6], 24, offload), reference_tokens), offload


def test_host_heads_round_the_fraction_up_to_whole_heads():
    assert [host_kv_heads(alpha, 8) for alpha in (0.0, 0.01, 0.125, 0.3, 0.5, 1.0)] == [0, 1, 1, 3, 4, 8]
    with pytest.raises(ValueError, match="offload fraction"):
        host_kv_heads(1.5, 8)


def test_offloaded_cache_reports_the_bytes_of_its_tensors():
    cache = OffloadedKVCache(2, 4, 16, 8, torch.float32, "cpu", host_heads=1)
    assert cache.on_device.k.shape == (2, 3, 16, 8) and cache.in_host.k.shape == (2, 1, 16, 8)
    tensors = [cache.on_device.k, cache.on_device.v, cache.in_host.k, cache.in_host.v]
    assert cache.nbytes() == {"cpu": sum(t.nbytes for t in tensors)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_on_cuda_offloaded_heads_live_in_pinned_host_memory_and_give_the_same_outputs(dtype, tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama", **FOUR_KV_HEADS)
    stack, head = load_block_stack(folder, 0, 4, dtype=dtype, device="cuda"), load_client_head(folder)
    head = head.to("cuda", dtype)
    torch.manual_seed(3)
    ids = torch.randint(1, 128, (3, 20), device="cuda")
    padding = torch.ones(3, 20, dtype=torch.bool, device="cuda")
    with torch.no_grad():
        reference, _ = run(stack, head, ids, padding, 0.0, prompt=12)
        for offload in OFFLOADS:
            hidden, caches = run(stack, head, ids, padding, offload, prompt=12)
            assert all(cache.in_host.k.is_pinned() and cache.in_host.k.device.type == "cpu" for cache in caches)
            assert all(cache.on_device is None or cache.on_device.k.is_cuda for cache in caches)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # the CPU attends the host heads in its own kernels
            assert (hidden.float() - reference.float()).abs().max() <= tolerance, offload
