"""The KV cache: one per block, written at explicit slots, read as a prefix (gpt-fast style)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (q, k, v, mask, first_head) -> out, q's heads being the block's heads from first_head on
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def compact_slots(tensor: torch.Tensor, slot_dim: int, start: int, keep: list[torch.Tensor], batch_offset: int = 0) -> None:
    """In place, for each row r of rows [batch_offset, + len(keep)): move slots start + keep[r] (offsets, ascending)
    to start, start + 1, ... along `slot_dim` (dimension 0 is the row). What lies after them is left as it was."""
    for row, offsets in enumerate(keep):
        if offsets.numel() == 0:
            continue
        target = tensor[batch_offset + row]
        offsets = offsets.to(target.device, torch.long)
        kept = target.index_select(slot_dim - 1, start + offsets)
        target.narrow(slot_dim - 1, start, offsets.numel()).copy_(kept)


class KVCache:
    """Keys and values of one block for a whole batch: tensors ``[batch, kv_heads, max_length, head_dim]`` (the
    values ``value_dim`` wide where that differs: latent attention's).

    ``update`` writes the new keys/values of rows ``[batch_offset, batch_offset + b)`` at
    ``cache_positions`` and returns those rows' readable prefix, slots ``[0, length)``; ``attend``
    does that and runs the attention over the prefix.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", pin_memory: bool = False,
                 value_dim: int | None = None):
        shape = (batch_size, num_kv_heads, max_length)
        options = dict(dtype=dtype, device=device, pin_memory=pin_memory)
        self.k = torch.zeros(*shape, head_dim, **options)
        self.v = torch.zeros(*shape, value_dim or head_dim, **options)
        self._step_views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}  # `write_step`'s, kept

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by device type ('cpu', 'cuda', ...)."""
        return {self.k.device.type: self.k.nbytes + self.v.nbytes}

    def update(self, cache_positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch_offset: int = 0, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` ``[b, kv_heads, T, head_dim]`` at slots ``cache_positions`` ``[T]``; return slots [0, length)."""
        if length is None:
            length = int(cache_positions.max()) + 1
        if length > self.max_length:
            raise ValueError(f"KV cache read of {length} slots exceeds its max_length {self.max_length}; "
                             f"allocate a longer cache.")
        rows = self.write(cache_positions, k, v, batch_offset)
        return self.k[rows, :, :length], self.v[rows, :, :length]

    def write(self, cache_positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch_offset: int = 0) -> slice:
        """Write ``k, v`` ``[b, kv_heads, T, head_dim]`` at slots ``cache_positions`` ``[T]``; the rows written."""
        rows = self._rows(batch_offset, k.shape[0])
        self._write_into(self.k[rows], self.v[rows], cache_positions, k, v)
        return rows

    def write_step(self, cache_positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch_offset: int,
                   length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` for one-token steps, whose rows and read length repeat step after step: the views it writes
        and reads are made once per (rows, length) and kept, which saves a batched forward a few tensor operations
        per step and block. Slots past the cache's capacity read as zeros (a longer cache's company)."""
        key = (batch_offset, k.shape[0], length)
        if key not in self._step_views:
            rows = self._rows(batch_offset, k.shape[0])
            k_rows, v_rows = self.k[rows], self.v[rows]
            self._step_views[key] = k_rows, v_rows, k_rows[:, :, :length], v_rows[:, :, :length]
        k_rows, v_rows, k_prefix, v_prefix = self._step_views[key]
        self._write_into(k_rows, v_rows, cache_positions, k, v)
        if length > self.max_length:
            return tuple(F.pad(rows, (0, 0, 0, length - self.max_length)) for rows in (k_rows, v_rows))
        return k_prefix, v_prefix

    def _rows(self, batch_offset: int, count: int) -> slice:
        """Rows [batch_offset, + count); ValueError unless the cache has them."""
        if batch_offset < 0 or batch_offset + count > self.batch_size:
            raise ValueError(f"KV cache rows [{batch_offset}, {batch_offset + count}) are outside the cache's "
                             f"{self.batch_size} rows; allocate the cache for the full batch.")
        return slice(batch_offset, batch_offset + count)

    def _write_into(self, k_rows: torch.Tensor, v_rows: torch.Tensor, cache_positions: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """Write ``k, v`` at slots ``cache_positions`` of the cache's rows ``k_rows, v_rows``, in the cache's dtype."""
        k_rows.index_copy_(2, cache_positions, k if k.dtype == self.k.dtype else k.to(self.k.dtype))
        v_rows.index_copy_(2, cache_positions, v if v.dtype == self.v.dtype else v.to(self.v.dtype))

    def reorder(self, rows: torch.Tensor) -> None:
        """Row i takes what row ``rows[i]`` held (beam search's hypotheses)."""
        self.k.copy_(self.k[rows.to(self.k.device)])
        self.v.copy_(self.v[rows.to(self.v.device)])

    def compact(self, start: int, keep: list[torch.Tensor], batch_offset: int = 0) -> None:
        """Keep slots start + keep[r] of each row at start, start + 1, ... (``compact_slots``)."""
        compact_slots(self.k, 2, start, keep, batch_offset)
        compact_slots(self.v, 2, start, keep, batch_offset)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_positions: torch.Tensor,
               batch_offset: int, mask: torch.Tensor, attention: Attention, first_head: int = 0) -> torch.Tensor:
        """Write ``k, v`` and attend ``q`` ``[b, heads, T, d]`` (the block's heads from ``first_head`` on) over slots
        [0, mask.shape[-1]) under ``mask`` [b, T, S]."""
        keys, values = self.update(cache_positions, k, v, batch_offset, mask.shape[-1])
        return attention(q, keys, values, mask, first_head)
