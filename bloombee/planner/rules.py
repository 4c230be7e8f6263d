"""The two break-even rules of the model of the chain, each defined once.

Codec (the paper's section 6): sending ``N`` raw bytes over a link of bandwidth ``B`` takes ``N / B``;
compressing first takes ``E + N / C`` to encode, ``N / (r B)`` to send and ``F + N / D`` to decode
(``r`` the ratio, ``C`` and ``D`` encode and decode speeds in raw bytes per second, ``E + F`` the CPU
time of the two calls beyond their bytes). Compression pays iff ``B < B*(N)``, where

    B*(N) = (1 - 1/r) / (1/C + 1/D + (E + F) / N).

Speculation (the paper's equation 8): a plain round commits one token per row in
``F_plain + K_plain / S``, a tree round ``a`` tokens in ``F_tree + K_tree / S`` plus the draft's ``c``
(``F`` the time apart from moving bytes, ``K`` the bytes, ``S`` the slowest link). Speculation is faster
iff ``S > S* = (K_tree - a K_plain) / (a F_plain - F_tree - c)``.

Both take numbers or numpy arrays (the planner applies the codec rule to every pair of machines at once).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np


def codec_break_even(ratio, compress_speed, decompress_speed, call_s=0.0, num_bytes=math.inf):
    """B* (bytes/s): compressing a message of `num_bytes` raw bytes pays on links slower than this (0 where the
    ratio saves nothing, nan where a figure is missing)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        saved = np.maximum(1.0 - 1.0 / np.asarray(ratio, dtype=np.float64), 0.0)
        cost = 1.0 / np.asarray(compress_speed, dtype=np.float64) + 1.0 / np.asarray(decompress_speed, dtype=np.float64)
        result = saved / (cost + np.asarray(call_s, dtype=np.float64) / np.asarray(num_bytes, dtype=np.float64))
    return float(result) if result.ndim == 0 else result


@functools.lru_cache(maxsize=1024)
def message_break_even(ratio: float, compress_speed: float, decompress_speed: float, call_s: float,
                       num_bytes: int) -> float:
    """`codec_break_even` of one message's figures, remembered: a link's codec policy asks it at every message, its
    figures change only when a compressed message measures them, and the array arithmetic costs more than the rest
    of the policy's decision."""
    return codec_break_even(ratio, compress_speed, decompress_speed, call_s, num_bytes)


def compression_pays(bandwidth, ratio, compress_speed, decompress_speed, call_s=0.0, num_bytes=math.inf):
    """Whether compressing a message of `num_bytes` raw bytes is faster on a link of `bandwidth` bytes/s."""
    with np.errstate(invalid="ignore"):
        pays = np.asarray(bandwidth) < codec_break_even(ratio, compress_speed, decompress_speed, call_s, num_bytes)
    return bool(pays) if pays.ndim == 0 else pays


def slowest_link_bytes(sent: Sequence[float], bandwidths: Sequence[float]) -> float:
    """Equation 8's K: bytes moved over each hop, each weighted by the slowest link's bandwidth over that hop's (the
    bytes it would take the slowest link as long to move)."""
    slowest = min(bandwidths)
    return sum(size * slowest / bandwidth for size, bandwidth in zip(sent, bandwidths))


def transfer_seconds(num_bytes: float, bandwidth: float) -> float:
    """Seconds `num_bytes` take on a link of `bandwidth` bytes/s (0 on an unbounded one)."""
    return num_bytes / bandwidth


def speculation_break_even(extra_bytes: float, saved_s: float) -> float:
    """S* (bytes/s) for the extra (weighted) bytes a tree moves per committed token's worth of rounds
    (K_tree - a K_plain) and the time it saves apart from transfers (a F_plain - F_tree - c): speculation is faster
    on links faster than S* (inf: on none, 0: on all)."""
    if saved_s <= 0:
        return math.inf
    return max(extra_bytes / saved_s, 0.0)


def speculation_pays(slowest_bandwidth: float, extra_bytes: float, saved_s: float) -> bool:
    """Whether speculating beats plain decoding when the slowest link moves `slowest_bandwidth` bytes/s."""
    return extra_bytes / slowest_bandwidth < saved_s
