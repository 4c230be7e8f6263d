"""Attention with an explicit KV cache: write at slots, read a prefix, apply an explicit boolean mask."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache, partial

import torch
import torch.nn.functional as F
from torch import nn

from bloombee.models.core.config import BlockConfig
from bloombee.models.core.masks import causal_mask, sliding_window_mask
from bloombee.models.core.packing import Cache, Packing, Segment, additive_bias, granule_slots
from bloombee.models.core.norms import NORMS, RMSNorm
from bloombee.models.core.rotary import apply_rotary


LATENT_NORM_EPS = 1e-6  # latent attention's q and kv norms (transformers builds them with the default eps)


class _AttentionBase(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.scale = cfg.attn_scale or (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = cfg.attn_softcap
        self.alibi = cfg.alibi
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None
        self.tree_nodes_alone = False  # batch-invariant mode: tree steps attend node by node (`attend_tree_nodes`)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> q [N, h, d], k, v [N, kv, d] (before rotary)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, packing: Packing,
                caches: Sequence[Cache | None]) -> torch.Tensor:
        """Packed x [N, H] of `packing`'s segments (each with its cache of this block, or None) -> [N, H]."""
        q, k, v = self.project(x)
        if cos is not None:
            q, k = self.rotate(q, k, cos, sin)
        decode = packing.decode
        decoded = self.attend_decode(q, k, v, packing, caches) if decode is not None else None
        if decode is not None and len(decode.members) == len(packing.segments):
            outputs = [decoded]
        else:
            outputs = self._attend_apart(q, k, v, packing, caches, decoded)
        padding = x.shape[0] - packing.slices[-1].stop  # rows past the segments' (invariance)
        if padding:
            outputs.append(outputs[0].new_zeros(padding, outputs[0].shape[1]))
        return self.o_proj(torch.cat(outputs) if len(outputs) > 1 else outputs[0])

    def _attend_apart(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                      caches: Sequence[Cache | None], decoded: torch.Tensor | None) -> list[torch.Tensor]:
        """Each segment's attention output [size, heads x value dim], in order: the decode batch's rows from
        `decoded`, every other segment attending on its own."""
        decode = packing.decode
        outputs = dict(zip(decode.members, decoded.split(decode.row_counts))) if decoded is not None else {}
        for index, (segment, cache, part) in enumerate(zip(packing.segments, caches, packing.slices)):
            if index not in outputs:
                shape = (segment.rows, segment.tokens)
                q_s, k_s, v_s = (t[part].unflatten(0, shape).transpose(1, 2) for t in (q, k, v))
                out = self._attend_segment(q_s, k_s, v_s, segment, cache, packing.granule)
                outputs[index] = out.transpose(1, 2).reshape(segment.size, -1)
        return [outputs[index] for index in range(len(packing.segments))]

    def attend_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                       caches: Sequence[Cache | None]) -> torch.Tensor:
        """The one-token steps' attention as one batch (`packing.DecodeBatch`): each step's key and value written to
        its cache, then every row over its cache's first `length` slots, gathered -> [B, heads x value dim]."""
        decode = packing.decode
        steps = [t[decode.vectors].unsqueeze(2).split(decode.row_counts) for t in (k, v)]
        keys, values = [], []
        for index, k_step, v_step in zip(decode.members, *steps):
            segment = packing.segments[index]
            prefix = caches[index].write_step(segment.cache_positions, k_step, v_step, segment.batch_offset,
                                              decode.length)
            keys.append(prefix[0])
            values.append(prefix[1])
        keys, values = (torch.cat(parts) if len(parts) > 1 else parts[0] for parts in (keys, values))
        queries = q[decode.vectors].unsqueeze(2)
        if not self.eager_one_token:
            return self.attend(queries, keys, values, decode.masks(self.sliding_window)).flatten(1)
        bias = decode.bias(self.sliding_window, keys.shape[1], queries.dtype)
        return self._eager_one_token(queries, keys, values, bias).flatten(1)

    @property
    def eager_one_token(self) -> bool:
        """Whether `attend_one_token` computes this attention by `_eager_one_token` (plain attention) rather than
        by `attend`."""
        return (not self.alibi and self.sinks is None and self.softcap is None
                and type(self).attend is _AttentionBase.attend)

    def attend_one_token(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         first_head: int = 0) -> torch.Tensor:
        """`attend` of one query per row, q [b, h, 1, d]: plain attention by `_eager_one_token`."""
        if not self.eager_one_token:
            return self.attend(q, k, v, mask, first_head)
        return self._eager_one_token(q, k, v, additive_bias(mask, k.shape[1], q.dtype))

    def _eager_one_token(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q [b, h, 1, d] over k, v [b, kv, S, d] plus `bias` [b x kv, 1, S]: matmuls of each KV head's group of
        queries, the softmax in float32 (transformers' eager attention), which on a CPU computes a few rows several
        times faster than scaled_dot_product_attention, most of all in bfloat16 (benchmarks/README.md)."""
        b, heads, _, d = q.shape
        kv_heads, length = k.shape[1], k.shape[2]
        scores = torch.baddbmm(bias, q.reshape(b * kv_heads, heads // kv_heads, d),
                               k.reshape(b * kv_heads, length, d).transpose(1, 2), alpha=self.scale)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(weights, v.reshape(b * kv_heads, length, v.shape[-1])).view(b, heads, 1, -1)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, h, d], k [N, kv, d] rotated by their positions' cos, sin [N, d_rot]."""
        return apply_rotary(q, k, cos, sin)

    def _attend_segment(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment: Segment,
                        cache: Cache | None, granule: int | None) -> torch.Tensor:
        """One segment's attention: q [b, h, T, d], k, v [b, kv, T, d] written to its cache, over its keys (a tree's
        nodes attended one at a time over keys padded to whole `granule`s, as a one-token step's are)."""
        positions, mask, T = segment.cache_positions, segment.mask, segment.tokens
        if cache is not None:
            length = mask.shape[-1] if mask is not None else int(positions.max()) + 1
            if mask is None:
                mask = causal_mask(positions, length)
        elif mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None]
        if self.sliding_window is not None:
            key_slots = torch.arange(mask.shape[-1], device=q.device) if cache is not None else positions
            mask = mask & sliding_window_mask(positions, key_slots, self.sliding_window)
        attention = self.attend
        if self.tree_nodes_alone and segment.tree_start is not None:
            attention = partial(self.attend_tree_nodes, segment.tree_start, granule)
        elif granule is not None and T == 1 and segment.tree_start is None and cache is not None:
            mask, attention = F.pad(mask, (0, granule_slots(mask.shape[-1]) - mask.shape[-1])), self.attend_one_token
        if cache is not None:
            return cache.attend(q, k, v, positions, segment.batch_offset, mask, attention)
        return attention(q, k, v, mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               first_head: int = 0) -> torch.Tensor:
        """Attention of q [b, h, T, d] over k, v [b, kv, S, d] (each KV head serving its group of query heads);
        q's heads are the block's heads from ``first_head`` on (an offloaded cache attends its parts apart)."""
        if self.alibi:
            return self._attend_with_alibi(q, k, v, mask, first_head)
        if self.sinks is not None:
            return self._attend_with_sinks(q, k, v, mask, first_head)
        if self.softcap is not None:
            return self._attend_softcapped(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=self.scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def _attend_softcapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`attend` with the scores soft-capped before the mask (which scaled_dot_product_attention cannot do); the
        softmax in float32."""
        k, v = _per_query_head(q, k, v)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
        return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    def _attend_with_alibi(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           first_head: int) -> torch.Tensor:
        """`attend` with ALiBi (bloom): the scaled scores plus each head's slope times the key's position, counted
        among the keys the query attends (as transformers counts it over the padding mask, and for a tree's node
        over its ancestors); the softmax in float32."""
        b, h, T, _ = q.shape
        k, v = _per_query_head(q, k, v)
        slopes = alibi_slopes(self.num_heads, q.device)[first_head:first_head + h]
        key_positions = mask.cumsum(-1) - 1
        bias = (slopes[:, None, None] * key_positions[:, None]).to(q.dtype)
        scores = torch.baddbmm(bias.flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), alpha=self.scale)
        scores = scores.view(b, h, T, -1).masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
        return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    def _attend_with_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           first_head: int) -> torch.Tensor:
        """`attend` with attention sinks (gpt_oss): each head's learned logit joins its softmax over the scores (in
        their dtype, its maximum subtracted first) and takes its share of the weight, then is dropped."""
        b, h, T, _ = q.shape
        k, v = _per_query_head(q, k, v)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
        sinks = self.sinks[first_head:first_head + h].to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, T, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        weights = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.matmul(weights.to(v.dtype), v)

    def attend_tree_nodes(self, start: int, granule: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor, first_head: int = 0) -> torch.Tensor:
        """`attend` of a tree step's nodes (slots from `start`) one at a time, each over its row's slots before the
        tree and its own ancestors' (itself included) in order, then masked slots up to whole `granule`s (None:
        none, by `attend`): the keys, values, mask and kernel (`attend_one_token`) a token decoded alone at its
        depth attends, so that it gets that token's bits."""
        prefix = torch.arange(start, device=q.device)

        def alone(row: int, node: int) -> torch.Tensor:
            slots = torch.cat([prefix, mask[row, node, start:].nonzero().squeeze(1) + start])
            query, allowed = q[row:row + 1, :, node:node + 1], mask[row:row + 1, node:node + 1, slots]
            keys, values = k[row:row + 1, :, slots], v[row:row + 1, :, slots]
            if granule is None:
                return self.attend(query, keys, values, allowed, first_head)[0, :, 0]
            padding = granule_slots(len(slots)) - len(slots)
            keys, values = (F.pad(t, (0, 0, 0, padding)) for t in (keys, values))
            return self.attend_one_token(query, keys, values, F.pad(allowed, (0, padding)), first_head)[0, :, 0]

        return torch.stack([torch.stack([alone(row, node) for node in range(q.shape[2])], dim=1)
                            for row in range(q.shape[0])])


def _per_query_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [b, kv, S, d] repeated to one head per query head of q [b, h, T, d] (grouped-query attention)."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


@lru_cache
def alibi_slopes(num_heads: int, device: torch.device) -> torch.Tensor:
    """ALiBi's per-head slopes in float32: r^1 .. r^n, r = 2^(-8/n), for the largest power of two n <= heads, then
    the odd powers of 2^(-4/n) for the heads beyond n."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = _powers(2.0 ** (-8.0 / n), n, 1, device)
    if n < num_heads:
        slopes = torch.cat([slopes, _powers(2.0 ** (-4.0 / n), num_heads - n, 2, device)])
    return slopes


def _powers(ratio: float, count: int, step: int, device: torch.device) -> torch.Tensor:
    """ratio^1, ratio^(1 + step), ... (count of them), the powers taken in float32 (so that the slopes have the
    reference implementation's bits)."""
    base = torch.full((), ratio, dtype=torch.float32, device=device)
    return torch.pow(base, torch.arange(1, 1 + step * count, step, dtype=torch.int32, device=device))


class Attention(_AttentionBase):
    """Separate q/k/v projections; grouped-query heads; optional biases (the output projection's apart)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.output_bias)

    def project(self, x):
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        q, k = self.normalize(q, k)
        return q, k, v

    def normalize(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q, k [N, heads, d] before rotary: unchanged here."""
        return q, k


class QKNormAttention(Attention):
    """Attention with a per-head norm on queries and keys (qwen3's RMSNorm, gemma3's OffsetRMSNorm: the block
    config's ``qk_norm_class``): the spec's ``features.qk_norm``."""

    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        norm = NORMS[cfg.qk_norm_class]
        self.q_norm = norm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = norm(cfg.head_dim, cfg.norm_eps)

    def normalize(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class FusedQKVAttention(_AttentionBase):
    """One fused qkv projection (falcon, phi3). Layouts of its output features, per token:
    interleaved [h, 3, d]; multi_query [h + 2, d] (one K and one V head);
    grouped [kv, h/kv + 2, d] (each KV group: its queries, then K, then V);
    concatenated [h + 2 kv, d] (all query heads, then the K heads, then the V heads)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        self.layout = cfg.qkv_layout
        out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.output_bias)

    def project(self, x):
        n = x.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if self.layout == "interleaved":
            qkv = qkv.view(n, h, 3, d)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        elif self.layout == "multi_query":
            qkv = qkv.view(n, h + 2, d)
            q, k, v = qkv[:, :h], qkv[:, h:h + 1], qkv[:, h + 1:]
        elif self.layout == "grouped":
            qkv = qkv.view(n, kv, h // kv + 2, d)
            q = qkv[:, :, :-2].reshape(n, h, d)
            k, v = qkv[:, :, -2], qkv[:, :, -1]
        elif self.layout == "concatenated":
            qkv = qkv.view(n, h + 2 * kv, d)
            q, k, v = qkv[:, :h], qkv[:, h:h + kv], qkv[:, h + kv:]
        else:
            raise ValueError(f"unknown fused qkv layout {self.layout!r}")
        return q, k, v


class LatentAttention(_AttentionBase):
    """Multi-head latent attention (deepseek_v3): queries through an optional low-rank bottleneck; per token one
    normed latent (kv_lora_rank wide) and one rope key shared by all heads, which are what the KV cache holds (as
    its keys the rope keys, as its values the latents); each attention expands the latents through kv_b_proj into
    every head's key part without position and its value."""

    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        hidden, heads, rank = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        self.nope, self.rope, self.value_dim, self.rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, rank
        self.interleaved, self.low_rank_queries = cfg.rope_interleave, bool(cfg.q_lora_rank)
        if self.low_rank_queries:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.query_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * cfg.query_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(rank, heads * (self.nope + self.value_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.value_dim, hidden, bias=cfg.attention_bias)

    def project(self, x):
        """x [N, H] -> q [N, h, nope + rope], the rope key [N, 1, rope] and the latent [N, 1, rank]."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_queries else self.q_proj(x)
        latent, rope_key = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], -1)
        return q.unflatten(-1, (self.num_heads, -1)), rope_key[:, None], self.kv_a_layernorm(latent)[:, None]

    def rotate(self, q, k, cos, sin):
        """The queries' rope parts and the rope keys rotated, in adjacent pairs where the config interleaves them
        (the rotated pairs' first and second halves then stand apart, in queries and keys alike)."""
        q_pass, q_rot = q.split([self.nope, self.rope], -1)
        if not self.interleaved:
            q_rot, k = apply_rotary(q_rot, k, cos, sin)
            return torch.cat([q_pass, q_rot], -1), k
        cos, sin = cos[:, None, :self.rope // 2], sin[:, None, :self.rope // 2]

        def pairs(x: torch.Tensor) -> torch.Tensor:
            even, odd = x[..., 0::2], x[..., 1::2]
            return torch.cat([even * cos - odd * sin, odd * cos + even * sin], -1)

        return torch.cat([q_pass, pairs(q_rot)], -1), pairs(k)

    def attend(self, q, k, v, mask, first_head=0):
        """q [b, h, T, nope + rope] over the cached rope keys k [b, 1, S, rope] and latents v [b, 1, S, rank]; on the
        device of kv_b_proj's weight, also for an offloaded cache's part in host memory (its latents expand there)."""
        device = self.kv_b_proj.weight.device
        q, k, v, mask = (tensor.to(device) for tensor in (q, k, v, mask))
        heads = q.shape[1]
        expanded = self.kv_b_proj(v[:, 0]).unflatten(-1, (self.num_heads, -1))[:, :, first_head:first_head + heads]
        keys_nope, values = expanded.transpose(1, 2).split([self.nope, self.value_dim], -1)
        keys = torch.cat([keys_nope, k.expand(-1, heads, -1, -1)], -1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=self.scale)


ATTENTIONS = {"Attention": Attention, "FusedQKVAttention": FusedQKVAttention, "LatentAttention": LatentAttention}
