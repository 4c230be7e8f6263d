"""Core compute pieces: masks, KV cache, rotary scaling."""

from __future__ import annotations

import pytest
import torch

from bloombee.models.core import KVCache, masks

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def test_causal_mask_with_left_padding_never_empties_a_row():
    padding = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    mask = masks.causal_mask(torch.arange(4), 4, padding)
    assert mask.shape == (3, 4, 4)
    assert torch.equal(mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(mask[1], torch.eye(4, dtype=torch.bool))  # fully padded: own slot only
    assert mask[2, 3].tolist() == [False, False, True, True]
    assert mask.any(-1).all()
    # decode step: one query at slot 4 reading 5 slots
    step = masks.causal_mask(torch.tensor([4]), 5, torch.cat([padding, torch.ones(3, 1, dtype=torch.bool)], 1))
    assert step.shape == (3, 1, 5) and step[1, 0].tolist() == [False] * 4 + [True]


def test_rope_positions_from_padding():
    padding = torch.tensor([[1, 1, 1], [0, 1, 1]])
    assert masks.rope_positions_from_padding(padding).tolist() == [[0, 1, 2], [0, 0, 1]]


def test_sliding_window_mask():
    m = masks.sliding_window_mask(torch.tensor([5]), torch.arange(6), 3)
    assert m.tolist() == [[False, False, False, True, True, True]]


def test_kv_cache_writes_slots_and_rows():
    cache = KVCache(4, 2, 8, 3)
    k = torch.randn(2, 2, 2, 3)
    v = torch.randn(2, 2, 2, 3)
    k_read, v_read = cache.update(torch.tensor([3, 5]), k, v, batch_offset=2, length=6)
    assert k_read.shape == (2, 2, 6, 3)
    assert torch.equal(cache.k[2:, :, [3, 5]], k) and torch.equal(v_read[:, :, 5], v[:, :, 1])
    assert cache.k[:2].abs().sum() == 0  # other rows untouched
    assert cache.update(torch.tensor([6]), k[:, :, :1], v[:, :, :1])[0].shape[2] == 7  # default: up to max slot


def test_kv_cache_bounds():
    cache = KVCache(2, 1, 4, 3)
    with pytest.raises(ValueError, match="rows \\[1, 3\\)"):
        cache.update(torch.tensor([0]), torch.zeros(2, 1, 1, 3), torch.zeros(2, 1, 1, 3), batch_offset=1)
    with pytest.raises(ValueError, match="max_length 4"):
        cache.update(torch.tensor([0]), torch.zeros(1, 1, 1, 3), torch.zeros(1, 1, 1, 3), length=5)


def test_kv_cache_write_step_writes_and_reads_as_update_does():
    cache, twin = KVCache(3, 2, 64, 4), KVCache(3, 2, 64, 4)
    for slot in range(3):  # the same kept views step after step
        k, v = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
        step_keys, step_values = cache.write_step(torch.tensor([slot]), k, v, batch_offset=1, length=64)
        keys, values = twin.update(torch.tensor([slot]), k, v, batch_offset=1, length=64)
        assert torch.equal(step_keys, keys) and torch.equal(step_values, values)
    assert torch.equal(cache.k, twin.k) and torch.equal(cache.v, twin.v)
    longer = cache.write_step(torch.tensor([3]), k, v, batch_offset=1, length=128)[0]  # a longer cache's company
    assert longer.shape == (2, 2, 128, 4) and torch.equal(longer[:, :, :64], cache.k[1:]) and not longer[:, :, 64:].any()
    with pytest.raises(ValueError, match="rows \\[2, 4\\)"):
        cache.write_step(torch.tensor([0]), k, v, batch_offset=2, length=64)


@pytest.mark.parametrize("width", [16, 24, 32, 80, 128])
def test_rotation_of_packed_steps_equals_each_steps_own(width):
    """The packed forward computes cos and sin for all its steps' positions at once: each row's must be what the
    step alone gets, or a step's result would depend on its company."""
    from transformers import LlamaConfig

    from bloombee.models.core import RotaryEmbedding

    config = LlamaConfig(hidden_size=4 * width, num_attention_heads=4,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    rotary = RotaryEmbedding(config, width)
    assert rotary.fixed_frequencies
    positions = torch.tensor([0, 17, 3, 4, 5, 900, 41])
    for dtype in (torch.float32, torch.bfloat16):
        together = rotary(positions, dtype)
        for index in range(positions.numel()):
            alone = rotary(positions[index:index + 1], dtype)
            assert all(torch.equal(whole[index], part[0]) for whole, part in zip(together, alone))


@pytest.mark.parametrize("rope", [
    dict(rope_type="default", rope_theta=10000.0),
    dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=32),
    dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
])
def test_rotary_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from bloombee.models.core import RotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rope_parameters=rope)
    ours, ref = RotaryEmbedding(config, 16), LlamaRotaryEmbedding(config)
    positions = torch.arange(100)[None]  # beyond max_position_embeddings: dynamic scaling kicks in
    cos, sin = ours(positions, torch.float32)
    ref_cos, ref_sin = ref(torch.zeros(1), positions)
    assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)


def test_unsupported_rope_type():
    from transformers import LlamaConfig

    from bloombee.models.core import RotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4,
                         rope_parameters=dict(rope_type="default", rope_theta=1e4))
    config.rope_parameters["rope_type"] = "proportional"
    with pytest.raises(ValueError, match="rope type 'proportional' is not supported"):
        RotaryEmbedding(config, 16)


def test_norms_take_dim_and_eps_rmsnorm_has_no_bias():
    from bloombee.models.core import LayerNorm, RMSNorm

    rms, layer = RMSNorm(8, 1e-6), LayerNorm(8, 1e-5)
    assert [name for name, _ in rms.named_parameters()] == ["weight"]
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    x = torch.randn(2, 3, 8)
    assert torch.allclose(rms(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(layer(x), torch.nn.functional.layer_norm(x, (8,), eps=1e-5))


def test_a_qwen3_moe_config_with_dense_layers_is_refused_by_name():
    from transformers import Qwen3MoeConfig

    from bloombee.models import family_for_config

    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, mlp_only_layers=[1])
    with pytest.raises(ValueError, match=r"mlp_only_layers \[1\].*every layer must be a mixture of experts"):
        family_for_config(config).block_config(config, 0)
