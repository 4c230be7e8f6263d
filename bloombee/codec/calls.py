"""What codec calls cost on this machine, measured once per process: a fixed time per call and a speed per byte.

A call costs a fixed time (frame header, tensor views, the zstd context) plus time per byte; the fixed
part dominates small messages (a 16 KiB decode step's frame), so the break-even rule counts it. Both
depend on the machine, so each process measures them rather than taking another machine's figures:
the median CPU time of a few encodes and decodes at two sizes of bf16 activations, and the line
through them. The speeds and the ratio on that sample are what a compression policy starts from
until the messages it sends measure their own.
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
    """CPU seconds of one encode and of one decode beyond their bytes; the raw bytes per second of each beyond that,
    and the ratio reached, on the sample."""

    encode_s: float
    decode_s: float
    compress_speed: float
    decompress_speed: float
    ratio: float

    @property
    def both_s(self) -> float:
        return self.encode_s + self.decode_s


def cpu_times(num_bytes: int, repeats: int) -> tuple[float, float, float]:
    """Median CPU seconds of one encode (layout "auto") and one decode of a bf16 activation of `num_bytes` bytes, and
    the ratio the encode reached."""
    tensor = (torch.randn(num_bytes // 2, generator=torch.Generator().manual_seed(0)) * 0.5).to(torch.bfloat16)
    encodes, decodes, frame = [], [], b""
    for _ in range(repeats):
        began = time.thread_time()
        frame = encode(tensor, "auto")
        encoded = time.thread_time()
        decode(frame)
        encodes.append(encoded - began)
        decodes.append(time.thread_time() - encoded)
    return statistics.median(encodes), statistics.median(decodes), num_bytes / len(frame)


@functools.cache
def call_costs() -> CallCosts:
    """This machine's codec costs (measured at the first use, a few milliseconds)."""
    cpu_times(SMALL_BYTES, 2)  # warm-up: the first calls build the codec's tables
    small, large = cpu_times(SMALL_BYTES, REPEATS), cpu_times(LARGE_BYTES, REPEATS)
    per_byte = [max(big - little, 1e-12) / (LARGE_BYTES - SMALL_BYTES) for little, big in zip(small[:2], large[:2])]
    encode_s, decode_s = (max(little - SMALL_BYTES * rate, 0.0) for little, rate in zip(small, per_byte))
    return CallCosts(encode_s, decode_s, 1.0 / per_byte[0], 1.0 / per_byte[1], large[2])
