"""A step's micro-batches: how its rows split and join, the shapes a replay repeats, and where its time went."""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from bloombee.protocol import EncodedTensors, HopReport
from bloombee.speculative.tree import PackedTrees

SUMMED = ("raw_bytes", "wire_bytes", "decode_s", "decode_cpu_s", "compute_s", "compute_cpu_s", "encode_s")  # HopReport fields added up over micro-batches


def joined(outputs: dict[int, dict[str, torch.Tensor]], parts: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The micro-batches' hidden outputs in row order, as one tensor."""
    hidden = [outputs[offset]["hidden"] for offset, _ in parts]
    return hidden[0] if len(hidden) == 1 else torch.cat(hidden)


def join_trees(parts: list[PackedTrees]) -> PackedTrees:
    """Consecutive rows' packed trees as one."""
    offsets = [parts[0].offsets]
    for part in parts[1:]:
        offsets.append(part.offsets[1:] + offsets[-1][-1])
    return PackedTrees(torch.cat(offsets), *(torch.cat([getattr(part, name) for part in parts])
                                             for name in ("parents", "tokens", "ids")))


def split_rows(batch: int, parts: int) -> list[tuple[int, int]]:
    """(first row, rows) of `parts` micro-batches as even as possible, the larger ones first."""
    size, extra = divmod(batch, parts)
    bounds, first = [], 0
    for index in range(parts):
        rows = size + (index < extra)
        bounds.append((first, rows))
        first += rows
    return bounds


@dataclass(frozen=True)
class StepShape:
    """One step as the chain computed it: positions [start, start + tokens) in micro-batches of (first row, rows).

    A replay onto a replacement server repeats these shapes, because attention over many queries at once
    rounds differently from one query at a time (bfloat16 visibly): the same shapes give the same caches."""

    start: int
    tokens: int
    parts: tuple[tuple[int, int], ...]


def record_shape(shapes: list[StepShape], shape: StepShape) -> list[StepShape]:
    """The shapes that built the caches once `shape` is written over [shape.start, ...): later ones dropped."""
    if not shapes or shapes[-1].start + shapes[-1].tokens <= shape.start:  # the usual next step: nothing to drop
        return shapes + [shape]
    kept = [earlier for earlier in shapes if earlier.start < shape.start]
    if kept and kept[-1].start + kept[-1].tokens > shape.start:
        last = kept[-1]
        kept[-1] = StepShape(last.start, shape.start - last.start, last.parts)
    return kept + [shape]


def shapes_before(shapes: list[StepShape], end: int) -> list[StepShape]:
    """The recorded shapes clipped to positions [0, end)."""
    clipped = []
    for shape in shapes:
        if shape.start >= end:
            break
        clipped.append(StepShape(shape.start, min(shape.tokens, end - shape.start), shape.parts))
    return clipped


@dataclass
class StepStats:
    """Where one step's time and bytes went: the client's side and each server's report."""

    client_encode_s: float = 0.0
    client_decode_s: float = 0.0
    client_layout: str = "raw"
    sent_raw_bytes: int = 0
    sent_wire_bytes: int = 0
    received_wire_bytes: int = 0
    total_s: float = 0.0
    micro_batches: int = 1
    reports: list[HopReport] = field(default_factory=list)  # one per server, in chain order, summed over micro-batches
    sent_at: list[float] = field(default_factory=list)  # wall-clock time each micro-batch left the client
    received_at: list[float] = field(default_factory=list)  # ... and each output arrived, in arrival order
    micro_batch_reports: list[list[HopReport]] = field(default_factory=list)  # each output's reports, in arrival order
    sent: dict[int, tuple[str, int]] = field(default_factory=dict)  # first row -> (layout, raw bytes) the client sent
    received_decode_cpu_s: list[float] = field(default_factory=list)  # the client's decode CPU seconds of each output

    def add_sent(self, offset: int, encoded: EncodedTensors) -> None:
        self.sent_at.append(time.time())
        self.sent[offset] = (encoded.layout, encoded.raw_bytes)
        if not self.sent_raw_bytes:
            self.client_layout = encoded.layout
        self.client_encode_s += encoded.seconds
        self.sent_raw_bytes += encoded.raw_bytes
        self.sent_wire_bytes += encoded.wire_bytes

    def add_received(self, reports: tuple[HopReport, ...], decode_s: float, decode_cpu_s: float, wire_bytes: int) -> None:
        """One micro-batch's output arrived with every server's report of it."""
        self.received_at.append(time.time() - decode_s)
        self.micro_batch_reports.append(list(reports))
        self.received_decode_cpu_s.append(decode_cpu_s)
        self.client_decode_s += decode_s
        self.received_wire_bytes += wire_bytes
        if not self.reports:
            self.reports = list(reports)
            return
        self.reports = [mine.model_copy(update={name: getattr(mine, name) + getattr(theirs, name) for name in SUMMED})
                        for mine, theirs in zip(self.reports, reports)]
