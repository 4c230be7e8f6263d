"""Several sessions' steps through the blocks in one forward: their hidden vectors packed one after another.

Projections, norms and MLPs see one [N, hidden] matrix, so each weight is read once for all of them; attention
runs per segment over that segment's own KV cache under its own mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bloombee.models.core.kv_cache import KVCache
from bloombee.models.core.offload import OffloadedKVCache

Cache = KVCache | OffloadedKVCache


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
