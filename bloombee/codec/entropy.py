"""Order-0 byte entropy, used to skip zstd on lanes that would not shrink and as the benchmark's bound."""

from __future__ import annotations

import numpy as np

# Lanes longer than this are estimated from an evenly strided sample of about this many bytes.
# The plug-in estimate's downward bias at 64 Ki samples is (255 / (2 * 65536 * ln 2)) ≈ 0.003 bits.
ENTROPY_SAMPLE = 1 << 16


def byte_entropy(buf: np.ndarray, sample: int | None = ENTROPY_SAMPLE) -> float:
    """Shannon entropy in bits per byte of the byte histogram of ``buf`` (uint8, any shape).

    With ``sample`` set, a lane longer than it is estimated from a strided sample; ``sample=None``
    counts every byte (exact bound, used by the benchmark).
    """
    flat = buf.reshape(-1)
    if flat.size == 0:
        return 0.0
    if sample is not None and flat.size > sample:
        flat = flat[:: flat.size // sample]
    counts = np.bincount(flat, minlength=256)
    return entropy_of_counts(counts)


def entropy_of_counts(counts: np.ndarray) -> float:
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())
