"""Several sessions' steps through the blocks in one forward: their hidden vectors packed one after another.

Projections, norms and MLPs see one [N, hidden] matrix, so each weight is read once for all of them. Attention
is one batch for the one-token steps (decode steps: `DecodeBatch`): each writes its key and value to its own cache,
then their caches' first slots are gathered side by side and every row attends its own under its own mask. Other
steps (prompt chunks, speculative trees) attend apart, each over its own cache.

A one-token step attends its cache's slots up to the longest step's in the batch, rounded up to KEY_GRANULE, the
slots past its own masked; alone it reads its own length rounded up the same way. Where the attention kernel adds up
whole masked granules without changing a row's bits (probed at start in the batch-invariant mode,
`core.invariance.padding_invariant_attention`), a decode step's result does not depend on what shares its forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bloombee.models.core.kv_cache import KVCache
from bloombee.models.core.masks import sliding_window_mask
from bloombee.models.core.offload import OffloadedKVCache

Cache = KVCache | OffloadedKVCache
KEY_GRANULE = 64  # key slots: a multiple of any CPU vector loop's stride, so a masked granule adds whole vectors


def granule_slots(length: int) -> int:
    """`length` key slots rounded up to whole KEY_GRANULEs: what a one-token step attends, and what a KV cache
    allocates."""
    return -(-length // KEY_GRANULE) * KEY_GRANULE


@dataclass(frozen=True)
class Segment:
    """One step in a packed forward: `rows` x `tokens` vectors (row-major) written at slots `cache_positions` of rows
    [batch_offset, + rows) of `caches` (one per block of the forward; None: no cache), attending under `mask`."""

    rows: int
    tokens: int
    cache_positions: torch.Tensor  # [tokens]
    mask: torch.Tensor | None  # [rows, tokens, S] bool
    caches: Sequence[Cache] | None = None
    batch_offset: int = 0
    tree_start: int | None = None  # the slot a tree step's trees begin at (None: consecutive tokens)
    prompts: torch.Tensor | None = None  # [blocks, rows, prefix, H]: deep prompts added at slots < prefix before each block

    @property
    def size(self) -> int:
        return self.rows * self.tokens

    @property
    def adds_prompts(self) -> bool:
        """Whether the blocks add deep prompts to this step: it has them and writes a slot below the prefix length
        (a tree step never does)."""
        return (self.prompts is not None and self.tree_start is None
                and int(self.cache_positions[0]) < self.prompts.shape[2])

    def prompt_delta(self, block: int) -> torch.Tensor | None:
        """What block `block` (of the forward) adds to this segment's vectors [size, H] before it computes: its deep
        prompt at the slots below the prefix length (None: nothing, `adds_prompts` being false)."""
        if not self.adds_prompts:
            return None
        first, prefix = int(self.cache_positions[0]), self.prompts.shape[2]
        covered = self.prompts[block][:, first:min(prefix, first + self.tokens)]
        delta = F.pad(covered, (0, 0, 0, self.tokens - covered.shape[1]))
        return delta.reshape(self.size, delta.shape[-1])


def segment_slices(segments: Sequence[Segment]) -> list[slice]:
    """Where each segment's vectors lie in the packing."""
    slices, offset = [], 0
    for segment in segments:
        slices.append(slice(offset, offset + segment.size))
        offset += segment.size
    return slices


@dataclass(frozen=True)
class DecodeBatch:
    """The one-token steps of a packed forward, attended as one batch: `members` (indices of their segments), their
    rows, where their vectors lie in the packing, each row's mask padded to `length` key slots [B, 1, length], and
    the slot each row writes [B]."""

    members: list[int]
    row_counts: list[int]
    vectors: slice | torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    length: int
    _biases: dict = field(default_factory=dict)  # `bias` by its arguments: the blocks of a forward share them

    def masks(self, window: int | None) -> torch.Tensor:
        """The rows' masks [B, 1, length], within `window` slots of each row's query where that is set."""
        if window is None:
            return self.mask
        slots = torch.arange(self.length, device=self.mask.device)
        return self.mask & sliding_window_mask(self.positions, slots, window)[:, None]

    def bias(self, window: int | None, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """`additive_bias` of `masks(window)`."""
        key = (window, kv_heads, dtype)
        if key not in self._biases:
            self._biases[key] = additive_bias(self.masks(window), kv_heads, dtype)
        return self._biases[key]


def additive_bias(mask: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """A mask [b, 1, S] as what scores add: 0 where it allows, -inf where not, one row per row and KV head
    [b x kv_heads, 1, S]."""
    b, _, length = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias[:, None].expand(b, kv_heads, 1, length).reshape(b * kv_heads, 1, length)


@dataclass(frozen=True)
class Packing:
    """Segments packed one after another for a forward: where each one's vectors lie, its one-token steps as a
    `DecodeBatch` (None: there are none, or decode steps attend apart), and the key slots a one-token step's
    attention rounds up to (None: its own length)."""

    segments: Sequence[Segment]
    slices: list[slice]
    decode: DecodeBatch | None
    granule: int | None


def pack(segments: Sequence[Segment], batch_decode: bool = True) -> Packing:
    """The packing of `segments`; with `batch_decode`, their one-token steps over plain KV caches as one batch."""
    slices, granule = segment_slices(segments), KEY_GRANULE if batch_decode else None
    members = [index for index, segment in enumerate(segments) if batch_decode and _is_decode(segment)]
    if not members:
        return Packing(segments, slices, None, granule)
    length = granule_slots(max(segments[index].mask.shape[-1] for index in members))
    masks = [F.pad(segments[index].mask, (0, length - segments[index].mask.shape[-1])) for index in members]
    positions = [segments[index].cache_positions.expand(segments[index].rows) for index in members]
    if members == list(range(len(members))):
        vectors = slice(0, slices[members[-1]].stop)
    else:
        device = segments[members[0]].mask.device
        vectors = torch.cat([torch.arange(slices[index].start, slices[index].stop, device=device) for index in members])
    masks, positions = (torch.cat(parts) if len(parts) > 1 else parts[0] for parts in (masks, positions))
    decode = DecodeBatch(members, [segments[index].rows for index in members], vectors, masks, positions, length)
    return Packing(segments, slices, decode, granule)


def _is_decode(segment: Segment) -> bool:
    """A one-token step of consecutive tokens with its mask, over plain (not offloaded) KV caches."""
    return (segment.tokens == 1 and segment.tree_start is None and segment.mask is not None
            and segment.caches is not None and all(isinstance(cache, KVCache) for cache in segment.caches))
