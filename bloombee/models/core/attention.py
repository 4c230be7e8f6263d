"""Attention with an explicit KV cache: write at slots, read a prefix, apply an explicit boolean mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bloombee.models.core.config import BlockConfig
from bloombee.models.core.kv_cache import KVCache
from bloombee.models.core.masks import causal_mask, sliding_window_mask
from bloombee.models.core.offload import OffloadedKVCache
from bloombee.models.core.norms import RMSNorm
from bloombee.models.core.rotary import apply_rotary


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv, S, d] -> [b, kv * n_rep, S, d], each KV head repeated for its group of query heads."""
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class _AttentionBase(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.scale = cfg.head_dim ** -0.5

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, T, H] -> q [b, h, T, d], k, v [b, kv, T, d] (before rotary)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cache: KVCache | OffloadedKVCache | None, cache_positions: torch.Tensor, mask: torch.Tensor | None,
                batch_offset: int = 0) -> torch.Tensor:
        b, T, _ = x.shape
        q, k, v = self.project(x)
        if cos is not None:
            q, k = apply_rotary(q, k, cos, sin)
        if cache is not None:
            length = mask.shape[-1] if mask is not None else int(cache_positions.max()) + 1
            key_slots = torch.arange(length, device=x.device)
            if mask is None:
                mask = causal_mask(cache_positions, length)
        else:
            key_slots = cache_positions
            if mask is None:
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None]
        if self.sliding_window is not None:
            mask = mask & sliding_window_mask(cache_positions, key_slots, self.sliding_window)
        if cache is not None:
            out = cache.attend(q, k, v, cache_positions, batch_offset, mask, self.attend)
        else:
            out = self.attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, T, self.num_heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [b, h, T, d] over k, v [b, kv, S, d] (each KV head serving its group of query heads)."""
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask[:, None],
                                              scale=self.scale)


class Attention(_AttentionBase):
    """Separate q/k/v projections; grouped-query heads; optional biases."""

    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias)

    def project(self, x):
        b, T, _ = x.shape
        q = self.q_proj(x).view(b, T, -1, self.head_dim)
        k = self.k_proj(x).view(b, T, -1, self.head_dim)
        v = self.v_proj(x).view(b, T, -1, self.head_dim)
        q, k = self.normalize(q, k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def normalize(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q, k [b, T, heads, d] before rotary: unchanged here."""
        return q, k


class QKNormAttention(Attention):
    """Attention with a per-head RMSNorm on queries and keys (qwen3): the spec's ``features.qk_norm``."""

    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def normalize(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class FusedQKVAttention(_AttentionBase):
    """One fused qkv projection (falcon). Layouts of its output features, per token:
    interleaved [h, 3, d]; multi_query [h + 2, d] (one K and one V head);
    grouped [kv, h/kv + 2, d] (each KV group: its queries, then K, then V)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        self.layout = cfg.qkv_layout
        out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)

    def project(self, x):
        b, T, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if self.layout == "interleaved":
            qkv = qkv.view(b, T, h, 3, d)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        elif self.layout == "multi_query":
            qkv = qkv.view(b, T, h + 2, d)
            q, k, v = qkv[:, :, :h], qkv[:, :, h:h + 1], qkv[:, :, h + 1:]
        elif self.layout == "grouped":
            qkv = qkv.view(b, T, kv, h // kv + 2, d)
            q = qkv[:, :, :, :-2].reshape(b, T, h, d)
            k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        else:
            raise ValueError(f"unknown fused qkv layout {self.layout!r}")
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


ATTENTIONS = {"Attention": Attention, "FusedQKVAttention": FusedQKVAttention}
