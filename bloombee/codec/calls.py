"""The CPU time of one codec call beyond its bytes, measured on this machine once per process.

A call costs a fixed time (frame header, tensor views, the zstd context) plus time per byte; the fixed
part dominates small messages (a 16 KiB decode step's frame), so the break-even rule counts it. It
depends on the machine, so each process measures it rather than taking another machine's figure:
the median CPU time of a few encodes and decodes at two sizes of bf16 activations, and the line through them.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch

from .core import decode, encode

SMALL_BYTES, LARGE_BYTES = 4096, 65536  # the two sizes the line goes through
REPEATS = 15


@dataclass(frozen=True)
class CallCosts:
    """CPU seconds of one encode and of one decode beyond their bytes."""

    encode_s: float
    decode_s: float

    @property
    def both_s(self) -> float:
        return self.encode_s + self.decode_s


def cpu_times(num_bytes: int, repeats: int) -> tuple[float, float]:
    """Median CPU seconds of one encode (layout "auto") and one decode of a bf16 activation of `num_bytes` bytes."""
    tensor = (torch.randn(num_bytes // 2, generator=torch.Generator().manual_seed(0)) * 0.5).to(torch.bfloat16)
    encodes, decodes = [], []
    for _ in range(repeats):
        began = time.thread_time()
        frame = encode(tensor, "auto")
        encoded = time.thread_time()
        decode(frame)
        encodes.append(encoded - began)
        decodes.append(time.thread_time() - encoded)
    return statistics.median(encodes), statistics.median(decodes)


@functools.cache
def call_costs() -> CallCosts:
    """This machine's per-call codec costs (measured at the first use, a few milliseconds)."""
    cpu_times(SMALL_BYTES, 2)  # warm-up: the first calls build the codec's tables
    small, large = cpu_times(SMALL_BYTES, REPEATS), cpu_times(LARGE_BYTES, REPEATS)
    per_byte = [max(big - little, 0.0) / (LARGE_BYTES - SMALL_BYTES) for little, big in zip(small, large)]
    encode_s, decode_s = (max(little - SMALL_BYTES * rate, 0.0) for little, rate in zip(small, per_byte))
    return CallCosts(encode_s, decode_s)
