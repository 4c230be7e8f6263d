"""BlockStack (a server's contiguous blocks [start, end)) and ClientHead (embeddings, final norm, LM head).

One class each for every family: both take the family's ``Family`` (``bloombee.models.core.family``) and build
fresh parameters (the loader fills them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bloombee.models.core.family import Family
from bloombee.models.core.invariance import ChunkRange, padded_rows
from bloombee.models.core.kv_cache import KVCache
from bloombee.models.core.offload import OffloadedKVCache, host_kv_heads
from bloombee.models.core.packing import Segment, granule_slots, pack, segment_slices
from bloombee.models.core.rotary import RotaryEmbedding


class BlockStack(nn.Module):
    """Blocks [start, end) of one model of ``family``."""

    def __init__(self, family: Family, config, start: int, end: int):
        super().__init__()
        n = config.num_hidden_layers
        if not 0 <= start < end <= n:
            raise ValueError(f"block range [{start}, {end}) is not inside the model's {n} blocks [0, {n}).")
        self.family, self.config, self.start, self.end = family, config, start, end
        self.padded_rows_chunks: ChunkRange | None = None  # batch-invariant mode: a forward's rows padded once
        self.batch_decode = True  # one-token steps attend as one batch (core.packing; off where the batch-invariant
        # mode finds that this rounds a row by its company)
        self.block_configs = [self.family.block_config(config, i) for i in range(start, end)]
        self.blocks = nn.ModuleList(self.family.block_class(cfg, i)
                                    for cfg, i in zip(self.block_configs, range(start, end)))
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | str = "cpu") -> None:
        """(Re)create non-persistent buffers (rotary frequencies), e.g. after building on the meta device."""
        with torch.device(device):
            head_dim = self.block_configs[0].rotary_dim
            kinds = dict.fromkeys(cfg.rope_layer_type for cfg in self.block_configs) if self.family.rotary else {}
            # one per rope layer type among the blocks (None: the config's one); a plain dict, not submodules, so
            # that the frequencies stay in float32 on this device whatever the blocks are cast to
            self.rotaries = {kind: RotaryEmbedding(self.config, head_dim, kind) for kind in kinds}

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the blocks compute in (their norms' dtype: quantised linear weights are integers; modules that
        keep float32, as DeepSeek-V3's router, do not count)."""
        return next(p.dtype for module in self.modules() if not getattr(module, "keeps_float32", False)
                    for p in module.parameters(recurse=False) if p.dtype.is_floating_point)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def local_range(self, block_range: tuple[int, int] | None) -> tuple[int, int]:
        """Indices into ``self.blocks`` of absolute blocks [a, b) (all hosted blocks when None)."""
        if block_range is None:
            return 0, len(self.blocks)
        first, last = block_range
        if not self.start <= first < last <= self.end:
            raise ValueError(f"blocks [{first}, {last}) are not inside the hosted range [{self.start}, {self.end}).")
        return first - self.start, last - self.start

    def new_caches(self, batch_size: int, max_length: int, block_range: tuple[int, int] | None = None,
                   offload: float = 0.0) -> list[KVCache | OffloadedKVCache]:
        """One empty KV cache per block (of ``block_range``, default all), on the stack's device and dtype, with
        the fraction ``offload`` of each block's KV heads (rounded up to whole heads) in host memory; ``max_length``
        slots rounded up to what a one-token step attends (``core.packing.granule_slots``)."""
        lo, hi = self.local_range(block_range)
        dtype, device = self.dtype, self.device  # each a walk over the modules: once, not once a block
        caches = []
        for cfg in self.block_configs[lo:hi]:
            heads, key_dim, value_dim = cfg.cache_layout
            host_heads = host_kv_heads(offload, heads)
            shape = (batch_size, heads, granule_slots(max_length), key_dim, dtype, device)
            caches.append(OffloadedKVCache(*shape, host_heads, value_dim=value_dim) if host_heads
                          else KVCache(*shape, value_dim=value_dim))
        return caches

    def forward(self, hidden: torch.Tensor, rope_positions: torch.Tensor, caches: list[KVCache] | None,
                cache_positions: torch.Tensor, attention_mask: torch.Tensor | None,
                batch_offset: int = 0, block_range: tuple[int, int] | None = None,
                prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Run blocks ``block_range`` (absolute indices, default all hosted) with one cache each; deep ``prompts``
        [blocks, rows, prefix, H], if given, are added to the first prefix positions of each row before each block."""
        lo, hi = self.local_range(block_range)
        self._check_inputs(hidden, rope_positions, caches, cache_positions, attention_mask, hi - lo)
        rows, tokens, width = hidden.shape
        segment = Segment(rows, tokens, cache_positions, attention_mask, caches, batch_offset, prompts=prompts)
        out = self.forward_packed(hidden.reshape(rows * tokens, width), rope_positions.reshape(-1), [segment],
                                  block_range)
        return out.view(rows, tokens, width)

    def forward_packed(self, hidden: torch.Tensor, rope_positions: torch.Tensor, segments: Sequence[Segment],
                       block_range: tuple[int, int] | None = None) -> torch.Tensor:
        """Run blocks ``block_range`` over the packed vectors [N, H] of ``segments`` (rotary positions [N]): one
        forward for all of them, each segment attending its own caches (``bloombee.models.core.packing``)."""
        lo, hi = self.local_range(block_range)
        rotations = {kind: self._rotation(rotary, hidden.dtype, rope_positions, segments)
                     for kind, rotary in self.rotaries.items()}
        rows = hidden.shape[0]
        pad = padded_rows(rows, self.padded_rows_chunks) - rows if self.padded_rows_chunks else 0
        if pad:  # zero rows past the segments', so that no linear layer pads its own (core.invariance)
            hidden = F.pad(hidden, (0, 0, 0, pad))
            rotations = {kind: tuple(F.pad(t, (0, 0, 0, pad)) for t in cos_sin) for kind, cos_sin in rotations.items()}
        prompted = any(segment.adds_prompts for segment in segments)
        packing = pack(segments, self.batch_decode)
        for i, (block, cfg) in enumerate(zip(self.blocks[lo:hi], self.block_configs[lo:hi])):
            if prompted:
                hidden = hidden + self._prompt_deltas(segments, i, hidden)
            caches = [segment.caches[i] if segment.caches is not None else None for segment in segments]
            cos, sin = rotations.get(cfg.rope_layer_type, (None, None))
            hidden = block(hidden, cos, sin, packing, caches)
        return hidden[:rows] if pad else hidden

    @staticmethod
    def _prompt_deltas(segments: Sequence[Segment], block: int, hidden: torch.Tensor) -> torch.Tensor:
        """What block `block` adds to the packed vectors (padding rows included) before it: each segment's deep
        prompts (`Segment.prompt_delta`), zeros elsewhere."""
        parts = [segment.prompt_delta(block) for segment in segments]
        parts = [part.to(hidden.dtype) if part is not None else hidden.new_zeros(segment.size, hidden.shape[1])
                 for part, segment in zip(parts, segments)]
        pad = hidden.shape[0] - sum(segment.size for segment in segments)
        return F.pad(torch.cat(parts), (0, 0, 0, pad))

    @staticmethod
    def _rotation(rotary: RotaryEmbedding, dtype: torch.dtype, rope_positions: torch.Tensor,
                  segments: Sequence[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the packed positions: in one call where the frequencies are the same at every position, per
        segment otherwise (a dynamic or long rope scales by the segment's own longest position)."""
        if rotary.fixed_frequencies:
            return rotary(rope_positions, dtype)
        parts = [rotary(rope_positions[part], dtype) for part in segment_slices(segments)]
        cos, sin = (torch.cat(halves) if len(parts) > 1 else halves[0] for halves in zip(*parts))
        return cos, sin

    def _check_inputs(self, hidden, rope_positions, caches, cache_positions, attention_mask, num_blocks):
        h = self.config.hidden_size
        if hidden.dim() != 3 or hidden.shape[-1] != h:
            raise ValueError(f"hidden must be [batch, tokens, {h}], got {list(hidden.shape)}.")
        b, t, _ = hidden.shape
        if tuple(rope_positions.shape) != (b, t):
            raise ValueError(f"rope_positions must be [{b}, {t}], got {list(rope_positions.shape)}.")
        if tuple(cache_positions.shape) != (t,):
            raise ValueError(f"cache_positions must be [{t}], got {list(cache_positions.shape)}.")
        if caches is not None and len(caches) != num_blocks:
            raise ValueError(f"expected {num_blocks} caches (one per block), got {len(caches)}.")
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool or attention_mask.dim() != 3 or \
                    tuple(attention_mask.shape[:2]) != (b, t):
                raise ValueError(f"attention_mask must be a bool tensor [{b}, {t}, S], got "
                                 f"{attention_mask.dtype} {list(attention_mask.shape)}.")
            if caches is None and attention_mask.shape[2] != t:
                raise ValueError(f"without caches attention_mask must be [{b}, {t}, {t}], "
                                 f"got {list(attention_mask.shape)}.")


class ClientHead(nn.Module):
    """What the client holds of a model: token embeddings (and their norm, bloom's), the final norm (the blocks' norm
    class), LM head."""

    def __init__(self, family: Family, config):
        super().__init__()
        self.family, self.config = family, config
        norm_eps = family.block_config(config, 0).norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        norm_class = family.block_class.norm_class
        self.embed_norm = norm_class(config.hidden_size, norm_eps) if family.embedding_norm else None
        self.norm = norm_class(config.hidden_size, norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.family.scaled_embeddings:  # by sqrt(hidden_size) rounded to float32, then to the embeddings' dtype
            hidden = hidden * torch.tensor(self.config.hidden_size ** 0.5).to(hidden.dtype)
        if self.embed_norm is not None:
            hidden = self.embed_norm(hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap
