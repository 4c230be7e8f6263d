"""Which of float32 and bfloat16 multiplies a given small matrix faster on a device, measured.

Speculation's small models (the draft, the first server's proxy LM head) are bound by per-call overhead
or by reading their weights, not by arithmetic: a processor that multiplies bfloat16 natively reads half
the bytes, but on small matrices its bfloat16 kernels can cost more per call than float32's. Their
outputs only guide which candidates are sent and checked, never what is generated, so each part takes
whichever dtype runs it faster here.
"""

from __future__ import annotations

import logging
import statistics

import torch

from bloombee.models.core.timing import call_seconds

logger = logging.getLogger(__name__)

CANDIDATES = (torch.float32, torch.bfloat16)


def faster_dtype(weight: torch.Tensor, rows: int, repeats: int = 5) -> torch.dtype:
    """float32 or bfloat16: whichever multiplies `rows` inputs by `weight` (a copy in each dtype; no copy in its own)
    faster on its device (the median of a few timed runs after one warm-up)."""
    timings = {}
    for dtype in CANDIDATES:
        converted = weight.to(dtype)
        hidden = torch.randn(rows, converted.shape[1], device=converted.device, dtype=dtype)
        seconds = call_seconds(lambda: torch.nn.functional.linear(hidden, converted), converted.device, repeats + 1)
        timings[dtype] = statistics.median(seconds[1:])
    chosen = min(timings, key=timings.get)
    logger.debug("%s x %d rows: %.3f ms float32, %.3f ms bfloat16", list(weight.shape), rows,
                 1000 * timings[torch.float32], 1000 * timings[torch.bfloat16])
    return chosen
