"""How fast this server's blocks decode: measured at start (best of a few rounds, cached per model/range/device/dtype)
and refreshed from the steps it serves."""

import logging
import threading
import time
from pathlib import Path

import torch

from bloombee.planner.learning import Recent
from bloombee.progress import progress
from bloombee.server.backend import BlockBackend
from bloombee.measure_cache import CACHE_DIR, cached, store

logger = logging.getLogger(__name__)

ROUNDS = 3  # the best round counts: a busy moment of the machine slows some rounds, not all
SERVED_WINDOW = 16  # served steps whose mean is the running estimate
SERVED_BEFORE_TRUSTED = 8  # served batch-1 decode steps before they replace the start-up figure


def measure_block_throughput(backend: BlockBackend, steps: int = 8) -> float:
    """Decode steps per second through one block at batch 1: blocks x steps / seconds of the fastest round."""
    session = backend.new_session("throughput-probe", backend.start, backend.end, 1, ROUNDS * steps + 1)
    hidden = torch.randn(1, 1, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    backend.step(session, hidden, 0, 0, None, None)  # warm-up
    best = float("inf")
    positions = iter(range(1, ROUNDS * steps + 1))
    for _ in progress(range(ROUNDS), "measuring throughput", unit="round"):
        began = time.perf_counter()
        for _, position in zip(range(steps), positions):
            backend.step(session, hidden, position, 0, None, None)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        best = min(best, time.perf_counter() - began)
    return steps * (backend.end - backend.start) / best


class ThroughputMeter:
    """The announced block-steps/s: the start-up figure until enough batch-1 decode steps were served, then a
    the mean of the last of those steps' compute (so a figure measured under load corrects itself)."""

    def __init__(self, measured: float, cache_key: str, cache_path: Path = CACHE_DIR / "throughput.json"):
        self.measured, self.cache_key, self.cache_path = measured, cache_key, cache_path
        self._served = Recent(SERVED_WINDOW, statistic="mean")
        self._lock = threading.Lock()

    @property
    def value(self) -> float:
        with self._lock:
            return self._served.value if self._served.count >= SERVED_BEFORE_TRUSTED else self.measured

    def observe(self, vectors: int, blocks: int, seconds: float) -> None:
        """One served forward's compute; only forwards of one vector (a lone batch-1 decode step: what the figure
        means) count."""
        if vectors != 1 or seconds <= 0:
            return
        with self._lock:
            self._served.update(blocks / seconds)

    def save(self) -> None:
        """Keep the served figure for the next start (nothing to keep before enough steps were served)."""
        if self._served.count >= SERVED_BEFORE_TRUSTED:
            store(self.cache_path, self.cache_key, self.value)
            logger.info("Stored the served throughput %.1f block-steps/s for %s", self.value, self.cache_key)


def block_throughput_meter(backend: BlockBackend, key: str, cache_path: Path = CACHE_DIR / "throughput.json") -> ThroughputMeter:
    """The meter of `backend`, starting from the figure cached for `key` (measured the first time)."""
    measured = float(cached(cache_path, f"{key}|r{ROUNDS}", lambda: measure_block_throughput(backend)))
    logger.info("Throughput %.1f block-steps/s for %s", measured, key)
    return ThroughputMeter(measured, f"{key}|r{ROUNDS}", cache_path)
