"""How fast this server's blocks decode, alone and per row more in a batched forward (measured at start, best of a
few rounds, cached per model/range/device/dtype; both refreshed from the forwards it serves), and how loaded its
forwards are."""

import logging
import threading
import time
from collections import deque
from pathlib import Path

import torch

from bloombee.models.core.invariance import ChunkRange, chunk_linear_rows, row_range, unchunk_linear_rows
from bloombee.planner.chain import block_forward_seconds
from bloombee.planner.learning import Recent
from bloombee.progress import progress
from bloombee.server.backend import BlockBackend
from bloombee.measure_cache import CACHE_DIR, cached, store

logger = logging.getLogger(__name__)

ROUNDS = 3  # the best round counts: a busy moment of the machine slows some rounds, not all
SERVED_WINDOW = 16  # served steps whose mean is the running estimate
SERVED_BEFORE_TRUSTED = 8  # served batch-1 decode steps before they replace the start-up figure
BATCH_ROWS = 16  # rows of the decode forward that, beside a batch-1 one, gives what one more row costs
LOAD_WINDOW_S = 10.0  # seconds of served forwards whose mean size is the announced load
INVARIANCE_COST = 0.10  # --batch-invariant auto: the most the mode may slow a batch-1 decode step or a prompt
PROMPT_PROBE_TOKENS = 128  # tokens of the prompt whose slowdown --batch-invariant auto measures


def _fastest_step_seconds(backend: BlockBackend, rows: int, steps: int, label: str | None = None) -> float:
    """Seconds of a decode step of `rows` rows through all the backend's blocks: the fastest of ROUNDS rounds of
    `steps` steps (a progress bar named `label`, if given)."""
    session = backend.new_session("throughput-probe", backend.start, backend.end, rows, ROUNDS * steps + 1)
    hidden = torch.randn(rows, 1, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    backend.step(session, hidden, 0, 0, None, None)  # warm-up
    best = float("inf")
    positions = iter(range(1, ROUNDS * steps + 1))
    for _ in progress(range(ROUNDS), label, unit="round") if label else range(ROUNDS):
        began = time.perf_counter()
        for _, position in zip(range(steps), positions):
            backend.step(session, hidden, position, 0, None, None)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        best = min(best, time.perf_counter() - began)
    return best / steps


def measure_block_throughput(backend: BlockBackend, steps: int = 8) -> float:
    """Decode steps per second through one block at batch 1: blocks / seconds of a step in the fastest round."""
    seconds = _fastest_step_seconds(backend, 1, steps, "measuring throughput")
    return (backend.end - backend.start) / seconds


def measure_row_seconds(backend: BlockBackend, steps: int = 4) -> float:
    """Seconds one more row adds to a decode forward through one block: BATCH_ROWS-row against 1-row decode steps
    (the fastest rounds), per added row and block."""
    extra = _fastest_step_seconds(backend, BATCH_ROWS, steps) - _fastest_step_seconds(backend, 1, steps)
    return max(extra, 0.0) / (BATCH_ROWS - 1) / (backend.end - backend.start)


def measured_row_range(backend: BlockBackend, key: str,
                       cache_path: Path = CACHE_DIR / "throughput.json") -> ChunkRange | None:
    """`row_range` of the backend's blocks with this process's threads (measured once per `key` and thread count)."""

    def measure() -> dict | None:
        chunks = row_range(backend.stack, backend.dtype, backend.device)
        return None if chunks is None else {"floor": chunks.floor, "ceiling": chunks.ceiling,
                                            "seconds": list(chunks.seconds)}

    found = cached(cache_path, f"{key}|chunks|t{torch.get_num_threads()}", measure)
    return None if found is None else ChunkRange(found["floor"], found["ceiling"], tuple(found["seconds"]))


def _fastest_prompt_seconds(backend: BlockBackend, tokens: int) -> float:
    """Seconds of a one-row prompt of `tokens` tokens through all the backend's blocks, the fastest of ROUNDS (after
    one that warms up)."""
    hidden = torch.randn(1, tokens, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    backend.step(backend.new_session("prompt-probe", backend.start, backend.end, 1, tokens), hidden, 0, 0, None, None)
    best = float("inf")
    for _ in range(ROUNDS):
        session = backend.new_session("prompt-probe", backend.start, backend.end, 1, tokens)
        began = time.perf_counter()
        backend.step(session, hidden, 0, 0, None, None)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        best = min(best, time.perf_counter() - began)
    return best


def invariance_slowdown(backend: BlockBackend, chunks: ChunkRange, key: str,
                        cache_path: Path = CACHE_DIR / "throughput.json") -> float:
    """How much computing the blocks' matmuls in chunks of `chunks` rows slows a batch-1 decode step or a prompt of
    PROMPT_PROBE_TOKENS tokens here, whichever it slows more (measured once per `key`)."""

    def figures() -> tuple[float, float]:
        """Decode steps/s at batch 1 and the prompt's seconds."""
        return measure_block_throughput(backend), _fastest_prompt_seconds(backend, PROMPT_PROBE_TOKENS)

    def measure() -> float:
        plain_rate, plain_seconds = figures()
        chunk_linear_rows(backend.stack, chunks)
        try:
            chunked_rate, chunked_seconds = figures()
        finally:
            unchunk_linear_rows(backend.stack)
        return max(plain_rate / chunked_rate, chunked_seconds / plain_seconds)

    return float(cached(cache_path, f"{key}|invariance{chunks.floor}-{chunks.ceiling}|p{PROMPT_PROBE_TOKENS}", measure))


class ThroughputMeter:
    """The announced block-steps/s and seconds per further row: the start-up figures until enough forwards were
    served, then the mean of the last served batch-1 decode steps' compute, and of what each further one-vector step
    added to the forwards that held several (so figures measured alone correct themselves under load: the event
    loop's work and other processes slow a loaded server's forwards)."""

    def __init__(self, measured: float, cache_key: str, cache_path: Path = CACHE_DIR / "throughput.json",
                 row_seconds: float | None = None, load_window_s: float = LOAD_WINDOW_S):
        self.measured, self.cache_key, self.cache_path = measured, cache_key, cache_path
        self.load_window_s = load_window_s
        self.measured_row_seconds = row_seconds  # what one more row adds to a forward through one block, at start
        self._served = Recent(SERVED_WINDOW, statistic="mean")
        self._served_rows = Recent(SERVED_WINDOW, statistic="mean")
        self._forwards: deque[tuple[float, int]] = deque()  # (time.monotonic(), vectors) of recent forwards
        self._lock = threading.Lock()

    @property
    def value(self) -> float:
        with self._lock:
            return self._value()

    def _value(self) -> float:
        return self._served.value if self._served.count >= SERVED_BEFORE_TRUSTED else self.measured

    @property
    def row_seconds(self) -> float | None:
        with self._lock:
            if self._served_rows.count >= SERVED_BEFORE_TRUSTED:
                return self._served_rows.value
            return self.measured_row_seconds

    def forward_seconds(self, vectors: int, blocks: int) -> float:
        """What the model of the chain predicts, from these figures, for a forward of `vectors` vectors through
        `blocks` blocks."""
        return blocks * block_forward_seconds(self.value, self.row_seconds, vectors)

    @property
    def busy_vectors(self) -> float:
        """Mean vectors of the forwards of the last `load_window_s` seconds (0 when none ran)."""
        with self._lock:
            self._forget_before(time.monotonic() - self.load_window_s)
            return sum(vectors for _, vectors in self._forwards) / len(self._forwards) if self._forwards else 0.0

    def observe(self, vectors: int, blocks: int, seconds: float, steps: int = 1) -> None:
        """One served forward of `steps` steps: its size counts towards the load; its compute towards the throughput
        when it held one vector (a lone batch-1 decode step: what the figure means), towards the seconds per further
        row when it held several steps of one vector each (decode steps of sessions batched together)."""
        with self._lock:
            now = time.monotonic()
            self._forwards.append((now, vectors))
            self._forget_before(now - self.load_window_s)
            if seconds <= 0:
                return
            if vectors == 1:
                self._served.update(blocks / seconds)
            elif vectors == steps and self.measured_row_seconds is not None:
                self._served_rows.update(max(seconds / blocks - 1.0 / self._value(), 0.0) / (vectors - 1))

    def _forget_before(self, moment: float) -> None:
        while self._forwards and self._forwards[0][0] < moment:
            self._forwards.popleft()

    def save(self) -> None:
        """Keep the served figure for the next start (nothing to keep before enough steps were served)."""
        if self._served.count >= SERVED_BEFORE_TRUSTED:
            store(self.cache_path, self.cache_key, self.value)
            logger.info("Stored the served throughput %.1f block-steps/s for %s", self.value, self.cache_key)


def block_throughput_meter(backend: BlockBackend, key: str, cache_path: Path = CACHE_DIR / "throughput.json") -> ThroughputMeter:
    """The meter of `backend`, starting from the figure cached for `key` (measured the first time)."""
    measured = float(cached(cache_path, f"{key}|r{ROUNDS}", lambda: measure_block_throughput(backend)))
    row_seconds = float(cached(cache_path, f"{key}|rows{BATCH_ROWS}", lambda: measure_row_seconds(backend)))
    logger.info("Throughput %.1f block-steps/s for %s; one more row in a forward adds %.3f ms a block", measured, key,
                1e3 * row_seconds)
    return ThroughputMeter(measured, f"{key}|r{ROUNDS}", cache_path, row_seconds)
