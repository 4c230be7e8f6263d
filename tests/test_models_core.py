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
