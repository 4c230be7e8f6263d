"""Measure how fast this server's blocks decode, once per model/range/device/dtype, and cache the figure."""

import logging
import time
from pathlib import Path

import torch

from bloombee.progress import progress
from bloombee.server.backend import BlockBackend
from bloombee.server.measure_cache import CACHE_DIR, cached

logger = logging.getLogger(__name__)


def measure_block_throughput(backend: BlockBackend, steps: int = 8) -> float:
    """Decode steps per second through one block at batch 1 (total steps x blocks / seconds)."""
    num_blocks = backend.end - backend.start
    session = backend.new_session("throughput-probe", backend.start, backend.end, 1, steps + 1)
    hidden = torch.randn(1, 1, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    backend.step(session, hidden, 0, 0, None, None)  # warm-up
    began = time.perf_counter()
    for position in progress(range(1, steps + 1), "measuring throughput", unit="step"):
        backend.step(session, hidden, position, 0, None, None)
    if backend.device.type == "cuda":
        torch.cuda.synchronize(backend.device)
    elapsed = time.perf_counter() - began
    return steps * num_blocks / elapsed


def cached_block_throughput(backend: BlockBackend, key: str, cache_path: Path = CACHE_DIR / "throughput.json") -> float:
    """The measured throughput for `key`, measuring and storing it the first time."""
    throughput = float(cached(cache_path, key, lambda: measure_block_throughput(backend)))
    logger.info("Throughput %.1f block-steps/s for %s", throughput, key)
    return throughput
