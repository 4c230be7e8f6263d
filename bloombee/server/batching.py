"""Steps of many sessions through the blocks together: one forward for the steps ready at once.

Each session's pipeline hands its step here and waits for the result. While a forward runs in the compute thread,
steps that arrive wait; the next forward takes the oldest waiting step and, in arrival order, every other one of
the same blocks that keeps the forward within --max-batch-rows and --max-batch-tokens. A session has at most one
step waiting (its pipeline computes its steps in order), so sessions take turns. Decode steps (one token per row)
go ahead of an older, longer step (a prompt chunk, a tree) once, in a forward of their own; that step then goes
next, so none starves. A long prompt arrives as chunks, so a decode step waits behind one chunk at most: the one
computing when it came.

Sessions decoding at once settle into groups that alternate: one group's steps compute while the other's travel to
their clients and back. That keeps the device busy, and by default (--batch-wait-ms 0) a forward never waits: it
takes the steps ready when the device is free. Where a round trip is short beside a forward's fixed cost (reading
every weight), merging the groups pays instead: with --batch-wait-ms above 0 a forward first waits, up to that long,
for a step of each session that had one in the last two forwards, that this server computes alone (no other server
in its chain), and whose last turnaround (from its answer to its next step, less the time the event loop spent in
forwards meanwhile, when a step that came could not be read) brings it back before the wait ends, and for the first
step of each session opened since the last forward began. Sessions that other servers compute too keep their
turns: while one group computes here, the other computes on the next server (a pipeline).

A forward the model of the chain predicts to be short runs on the event loop itself: torch hands the interpreter lock
back and forth at every operation, and a compute thread sharing it with a busy event loop computes a small model's
forward up to twice as slowly as the loop alone does (benchmarks/README.md). A longer one runs in the compute thread,
so that the loop keeps serving meanwhile. Before it takes a forward's steps, the batcher lets the loop turn until
the steps the server has already received have reached it, so that they share the forward.
"""

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bloombee.server.backend import BlockBackend, PreparedStep

logger = logging.getLogger(__name__)

SETTLE_TURNS = 16  # event loop turns a received step surely takes to reach the batcher
INLINE_FORWARD_S = 0.1  # predicted seconds up to which a forward runs on the event loop (stalling it that long)


@dataclass(frozen=True)
class BatchLimits:
    max_rows: int  # rows of all steps in one forward
    max_tokens: int  # rows x positions of all steps in one forward
    wait_s: float  # how long a forward may wait for recent and new sessions' steps


@dataclass(frozen=True)
class ForwardTiming:
    """The forward a step went through: when it began (time.time()), seconds, CPU seconds, its blocks, and the
    vectors (rows x positions) and steps in it."""

    began_at: float
    seconds: float
    cpu_seconds: float
    blocks: int
    vectors: int
    steps: int


@dataclass(eq=False)
class _Waiting:
    session: str
    block_range: tuple[int, int]
    adapter: str | None
    rows: int
    tokens: int
    prepare: Callable[[], PreparedStep]  # called just before the forward, where it runs
    done: asyncio.Future
    whole_chain: bool  # no other server computes the session's steps
    passed_over: bool = False  # a forward of one-token steps went ahead of it

    @property
    def one_token(self) -> bool:
        """A decode step: one token per row."""
        return self.tokens == self.rows


class StepBatcher:
    """Gathers sessions' steps into forwards of `backend`, run on the event loop or by `run_compute` (the server's
    compute thread)."""

    def __init__(self, backend: BlockBackend, run_compute: Callable[..., Awaitable], limits: BatchLimits,
                 predict_seconds: Callable[[int, int], float],
                 on_forward: Callable[[ForwardTiming], None] = lambda timing: None):
        self.backend, self.run_compute, self.limits, self.on_forward = backend, run_compute, limits, on_forward
        self.predict_seconds = predict_seconds  # (vectors, blocks) -> the model of the chain's seconds of a forward
        self._waiting: list[_Waiting] = []
        self.forwards = self.steps = 0  # forwards run and the steps they computed
        self.forward_seconds = 0.0  # their wall time in all
        self._recent: deque[set[str]] = deque(maxlen=2)  # the sessions of the last two forwards
        self._answered: dict[str, tuple[float, float]] = {}  # per session of a whole chain: the event loop time its
        # last step was answered, and `_loop_in_forwards` then
        self._turnaround: dict[str, float] = {}  # per such session: its last step's turnaround
        self._loop_in_forwards = 0.0  # seconds the event loop has spent in forwards
        self._opened: set[str] = set()  # sessions opened since the last forward began, whose first step has not come
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def compute(self, session: str, block_range: tuple[int, int], rows: int, tokens: int,
                      prepare: Callable[[], PreparedStep], adapter: str | None = None,
                      whole_chain: bool = False) -> tuple[Any, ForwardTiming]:
        """The result of session `session`'s step `prepare()` makes (called just before its forward, computing
        `adapter`) and the forward it went through; raises what preparing or finishing the step raised.
        `whole_chain`: no other server computes the session's steps (forwards may wait for its next one)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._serve())
        loop = asyncio.get_running_loop()
        self._opened.discard(session)
        if session in self._answered:
            answered, in_forwards = self._answered.pop(session)
            self._turnaround[session] = loop.time() - answered - (self._loop_in_forwards - in_forwards)
        waiting = _Waiting(session, block_range, adapter, rows, tokens, prepare, loop.create_future(), whole_chain)
        self._waiting.append(waiting)
        self._arrived.set()
        try:
            return await waiting.done
        finally:
            if waiting in self._waiting:  # its session ended before the step ran
                self._waiting.remove(waiting)

    def opened(self, session: str) -> None:
        """Session `session` opened: its first step comes at once, so the next forward waits for it too, within the
        wait limit (sessions that open together then compute their prompts in one forward)."""
        self._opened.add(session)

    def forget(self, session: str) -> None:
        """Session `session` ended: forwards no longer wait for its steps."""
        self._opened.discard(session)
        for sessions in self._recent:
            sessions.discard(session)
        self._answered.pop(session, None)
        self._turnaround.pop(session, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _serve(self) -> None:
        try:
            await self._serve_forever()
        except Exception as error:
            logger.exception("The step batcher failed")
            for waiting in self._waiting:
                if not waiting.done.done():
                    waiting.done.set_exception(error)
            raise

    async def _serve_forever(self) -> None:
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            await self._settle()
            await self._gather()
            batch = self._take()
            self._opened.clear()
            if not batch:
                continue
            self._recent.append({waiting.session for waiting in batch})
            try:
                outcomes, timing = await self._run(batch)
            except Exception as error:  # the forward itself failed: every step in it gets the error
                outcomes, timing = [error] * len(batch), None
            for waiting, outcome in zip(batch, outcomes):
                if waiting.done.done():
                    continue
                if isinstance(outcome, Exception):
                    waiting.done.set_exception(outcome)
                else:
                    waiting.done.set_result((outcome, timing))
            answered = (asyncio.get_running_loop().time(), self._loop_in_forwards)
            self._answered.update((waiting.session, answered) for waiting in batch if waiting.whole_chain)

    async def _run(self, batch: list[_Waiting]) -> tuple[list, ForwardTiming]:
        """`_forward` of `batch`: on the event loop if it is predicted short, in the compute thread otherwise."""
        prepares, adapter = [waiting.prepare for waiting in batch], batch[0].adapter
        first, last = batch[0].block_range
        if self.predict_seconds(sum(waiting.tokens for waiting in batch), last - first) <= INLINE_FORWARD_S:
            began = time.perf_counter()
            try:
                return self._forward(prepares, adapter)
            finally:
                self._loop_in_forwards += time.perf_counter() - began
        return await self.run_compute(self._forward, prepares, adapter)

    async def _settle(self) -> None:
        """Let steps the server has already received reach the batcher (each passes a few queues on the way): turns
        of the event loop until SETTLE_TURNS of them bring no new one or the waiting steps fill a forward."""
        count = -1
        while count != len(self._waiting) and not self._full():
            count = len(self._waiting)
            for _ in range(SETTLE_TURNS):
                await asyncio.sleep(0)

    async def _gather(self) -> None:
        """Wait up to the wait limit for a step of each session of the last two forwards whose last turnaround brings
        it back by then (sessions of whole chains in step with each other) and of each session opened since the last
        forward began, unless the waiting ones fill a forward already."""
        if not self._waiting or not self.limits.wait_s:  # their sessions ended while they settled, or no waiting
            return
        deadline = asyncio.get_running_loop().time() + self.limits.wait_s
        expected = {session for session in set().union(*self._recent)
                    if self._answered.get(session, (math.inf,))[0] + self._turnaround.get(session, math.inf)
                    <= deadline} | self._opened
        while not expected <= {waiting.session for waiting in self._waiting} and not self._full():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                return

    def _full(self) -> bool:
        return (sum(waiting.rows for waiting in self._waiting) >= self.limits.max_rows
                or sum(waiting.tokens for waiting in self._waiting) >= self.limits.max_tokens)

    def _take(self) -> list[_Waiting]:
        """The oldest waiting step, then in arrival order each other of its blocks and adapter that fits the limits;
        but where the oldest is longer than a token per row and no forward has passed it over yet, the one-token
        steps waiting go first, without it (it goes next)."""
        live = [waiting for waiting in self._waiting if not waiting.done.done()]
        if not live:
            self._waiting.clear()
            return []
        oldest, candidates = live[0], live
        decode = [waiting for waiting in live if waiting.one_token]
        if decode and not oldest.one_token and not oldest.passed_over:
            oldest.passed_over = True
            candidates = decode
        batch, rows, tokens = [candidates[0]], candidates[0].rows, candidates[0].tokens
        for waiting in candidates[1:]:
            if (waiting.block_range == batch[0].block_range and waiting.adapter == batch[0].adapter
                    and rows + waiting.rows <= self.limits.max_rows
                    and tokens + waiting.tokens <= self.limits.max_tokens):
                batch.append(waiting)
                rows, tokens = rows + waiting.rows, tokens + waiting.tokens
        taken = set(map(id, batch))
        self._waiting = [waiting for waiting in live if id(waiting) not in taken]
        return batch

    def _forward(self, prepares: list[Callable[[], PreparedStep]], adapter: str | None) -> tuple[list, ForwardTiming]:
        """Prepare each step (a step that fails to is refused alone), one forward for the rest, each step's result or
        error, and the forward's timing."""
        began_at, began, began_cpu = time.time(), time.perf_counter(), time.thread_time()
        outcomes: list = []
        prepared: list[tuple[int, PreparedStep]] = []
        for index, prepare in enumerate(prepares):
            try:
                prepared.append((index, prepare()))
                outcomes.append(None)
            except Exception as error:
                outcomes.append(error)
        if prepared:
            for (index, _), result in zip(prepared, self.backend.run([step for _, step in prepared], adapter)):
                outcomes[index] = result
        blocks = prepared[0][1].block_range if prepared else (0, 0)
        timing = ForwardTiming(began_at, time.perf_counter() - began, time.thread_time() - began_cpu,
                               blocks[1] - blocks[0], sum(step.segment.size for _, step in prepared), len(prepared))
        if prepared:
            self.forwards, self.steps = self.forwards + 1, self.steps + len(prepared)
            self.forward_seconds += timing.seconds
            self.on_forward(timing)
        return outcomes, timing
