"""Order-0 byte entropy: the exact figure (the benchmark's bound) and a cheap estimate that decides
whether a lane is worth running through zstd."""

from __future__ import annotations

import math

import numpy as np

# The estimate looks at an evenly strided sample of at most this many bytes.
ESTIMATE_SAMPLE = 4096
# c * log2(c) for every count a sample can produce, so that the estimate is two numpy calls.
_C_LOG2_C = np.zeros(ESTIMATE_SAMPLE + 1)
_C_LOG2_C[1:] = np.arange(1, ESTIMATE_SAMPLE + 1) * np.log2(np.arange(1, ESTIMATE_SAMPLE + 1))


def byte_entropy(buf: np.ndarray) -> float:
    """Shannon entropy in bits per byte of the byte histogram of ``buf`` (uint8, any shape)."""
    counts = np.bincount(buf.reshape(-1), minlength=256)
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def estimate_byte_entropy(lane: np.ndarray) -> float:
    """Order-0 entropy (bits/byte) of a flat uint8 array from a strided sample of it.

    The plug-in estimate of a sample of ``n`` bytes reads low by about ``(K - 1) / (2 n ln 2)`` bits
    (``K`` byte values seen; 0.09 bits for a random 2 KiB lane); the Miller-Madow term adds that back.
    """
    sample = lane if lane.size <= ESTIMATE_SAMPLE else lane[:: lane.size // ESTIMATE_SAMPLE][:ESTIMATE_SAMPLE]
    n = sample.size
    if n == 0:
        return 0.0
    counts = np.bincount(sample, minlength=256)
    plug_in = math.log2(n) - float(_C_LOG2_C[counts].sum()) / n
    return plug_in + (np.count_nonzero(counts) - 1) / (2 * n * math.log(2))
