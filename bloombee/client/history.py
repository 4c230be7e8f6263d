"""What a session keeps to rebuild a replacement server's cache: its inputs, their token mask, its step shapes."""

import torch

from bloombee.client.steps import StepShape, record_shape, shapes_before
from bloombee.models.core.kv_cache import compact_slots


class SessionHistory:
    """The hidden states [batch, max_length, hidden] a session sent its first server, their token mask, and the
    shape of every step that built the servers' caches, which a replay repeats."""

    def __init__(self, batch_size: int, max_length: int, hidden_size: int):
        self.batch_size, self.max_length, self.hidden_size = batch_size, max_length, hidden_size
        self.inputs: torch.Tensor | None = None  # allocated at the first write, in the inputs' dtype
        self.mask = torch.zeros(batch_size, max_length, dtype=torch.bool)
        self.shapes: list[StepShape] = []  # in order

    def write(self, start: int, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Keep a step's inputs [batch, T, H] and token mask (None: all are tokens) at positions [start, start + T)."""
        with torch.inference_mode():
            if self.inputs is None:
                self.inputs = torch.zeros(self.batch_size, self.max_length, self.hidden_size, dtype=hidden.dtype)
            positions = slice(start, start + hidden.shape[1])
            self.inputs[:, positions].copy_(hidden)
            self.mask[:, positions] = True if mask is None else mask

    def record(self, shape: StepShape) -> None:
        """A step written over [shape.start, ...): later shapes are dropped."""
        self.shapes = record_shape(self.shapes, shape)

    def shapes_before(self, end: int) -> list[StepShape]:
        return shapes_before(self.shapes, end)

    def commit_tree(self, start: int, width: int, keep: list[torch.Tensor], one_at_a_time: bool) -> int:
        """Keep each row's accepted nodes `keep` of a tree written over [start, start + width), moved to the first
        slots; the positions it advances by (the longest). `one_at_a_time`: a replay repeats them one position per
        step, as the servers computed them (exact trees), else as one step."""
        advance = max(ids.numel() for ids in keep)
        with torch.inference_mode():
            compact_slots(self.inputs, 1, start, keep)
            self.mask[:, start:start + width] = False
            for row, ids in enumerate(keep):
                self.mask[row, start:start + ids.numel()] = True
        whole = ((0, self.batch_size),)
        for shape in ([StepShape(start + slot, 1, whole) for slot in range(advance)] if one_at_a_time
                      else [StepShape(start, advance, whole)]):
            self.record(shape)
        return advance

    def reorder(self, rows: torch.Tensor, end: int) -> None:
        """Row i of positions [0, end) takes what row rows[i] held (beam search)."""
        with torch.inference_mode():
            if self.inputs is not None:
                self.inputs[:, :end] = self.inputs[rows, :end]
            self.mask[:, :end] = self.mask[rows, :end]
