"""Sharing the swarm between requests: first come, first served, into at most `max_sessions` sessions at once.

Requests that arrive within `batch_window_ms` of each other (or wait together in the queue) go into one
inference session as rows of one batch when they fit: together at most `max_batch_rows` rows, and a
padded length (longest prompt + most new tokens) no longer than the longest any one of them needs alone, and
all greedy or all sampled (a greedy batch is generated speculatively, as generate() does).
"""

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from bloombee.api.errors import queue_full
from bloombee.api.generation import Job

logger = logging.getLogger(__name__)


def fits(batch: list[Job], job: Job, max_rows: int) -> bool:
    """Whether `job` can join `batch` in one session."""
    rows = sum(len(member.rows) for member in batch) + len(job.rows)
    members = [*batch, job]
    padded = max(len(p) for member in members for p in member.prompts) + max(member.max_tokens for member in members)
    greedy = {member.temperature == 0 for member in members}
    return rows <= max_rows and padded <= max(member.length for member in members) and len(greedy) == 1


class Scheduler:
    """Queues jobs and runs batches of them with `run(jobs)` in worker threads."""

    def __init__(self, run: Callable[[list[Job]], None], max_sessions: int, max_queue: int, max_batch_rows: int,
                 batch_window_s: float):
        self.run, self.max_sessions, self.max_queue = run, max_sessions, max_queue
        self.max_batch_rows, self.batch_window_s = max_batch_rows, batch_window_s
        self.waiting: deque[Job] = deque()
        self.active: dict[asyncio.Task, list[Job]] = {}
        self.batches_run = 0
        self.largest_batch = 0  # most requests that shared one session so far
        self._wake = asyncio.Event()

    def submit(self, job: Job) -> None:
        """Queue a job, or refuse it (HTTP 429) when `max_queue` jobs are waiting already."""
        if len(self.waiting) >= self.max_queue:
            raise queue_full(len(self.waiting))
        self.waiting.append(job)
        self._wake.set()

    async def serve(self) -> None:
        """Start batches whenever a session slot is free and jobs wait; runs until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.waiting and len(self.active) < self.max_sessions:
                await asyncio.sleep(self.batch_window_s)  # let requests sent together arrive
                batch = self._take_batch()
                if batch:
                    self.largest_batch = max(self.largest_batch, len(batch))
                    task = asyncio.create_task(asyncio.to_thread(self.run, batch))
                    self.active[task] = batch
                    task.add_done_callback(self._finished)

    def _take_batch(self) -> list[Job]:
        """The first waiting job and every later one that fits with it, cancelled ones dropped."""
        for job in [job for job in self.waiting if job.cancelled.is_set()]:
            self.waiting.remove(job)
        batch: list[Job] = []
        for job in list(self.waiting):
            if not batch or fits(batch, job, self.max_batch_rows):
                batch.append(job)
                self.waiting.remove(job)
        return batch

    def _finished(self, task: asyncio.Task) -> None:
        self.active.pop(task)
        self.batches_run += 1
        if not task.cancelled() and task.exception() is not None:
            logger.error("A batch runner failed: %r", task.exception())
        self._wake.set()

    def stats(self) -> dict:
        return {"active_sessions": len(self.active), "active_requests": sum(len(b) for b in self.active.values()),
                "waiting_requests": len(self.waiting), "batches_run": self.batches_run,
                "largest_batch": self.largest_batch, "max_sessions": self.max_sessions, "max_queue": self.max_queue}
