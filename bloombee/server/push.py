"""A server's outgoing push stream to the next server of a session's chain."""

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from bloombee.planner.rules import transfer_seconds
from bloombee.protocol import AckMessage, ErrorMessage, parse_message
from bloombee.protocol.service import block_service_stub

logger = logging.getLogger(__name__)


@dataclass
class PushStats:
    """What the server's push channels queued: the most bytes waiting at once, and how often a send waited."""

    peak_queued_bytes: int = 0
    waits: int = 0


class PushChannel:
    """Keeps one push stream to (peer, session) open and reports a failure through `on_failure` once.

    At most `buffer_bytes` wait in the channel for the stream to take them (one message always may):
    past that, `send` waits, so a next server that stops reading slows this one down. A push fails when
    the stream breaks, when the next server does not acknowledge a step within `timeout` seconds of
    when its bytes should have arrived over the link (`bandwidth` bytes/s, after those sent before it),
    or when the buffer has no room for `timeout` seconds.
    """

    def __init__(self, p2p: P2P, peer_id: str, session_id: str, on_failure: Callable[[str, str], None],
                 buffer_bytes: int, stats: PushStats, timeout: float, bandwidth: float):
        self.peer_id, self.session_id = peer_id, session_id
        self.buffer_bytes, self.stats, self.timeout, self.bandwidth = buffer_bytes, stats, timeout, bandwidth
        self._sent: dict[tuple[int, int], float] = {}  # (step id, row) -> when its ack is overdue, until acked
        self._arrives_by = 0.0  # when the last message the stream took should have arrived
        self._stub = block_service_stub(p2p, peer_id)
        self._outbox: deque[tuple[runtime_pb2.ExpertRequest, int, tuple[int, int]]] = deque()
        self._queued_bytes = 0
        self._changed = asyncio.Condition()
        self._on_failure = on_failure
        self._opening: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._closing = False
        self.failed = False

    def open(self) -> None:
        """Begin opening the push stream, unless it is open or opening: a server calls this as a session's first step
        arrives, so that the stream (a new libp2p stream and its handler at the next server: ~2 ms here) is ready when
        the step's output is."""
        if self._opening is None and not self.failed:
            self._opening = asyncio.create_task(self._open())

    async def _open(self) -> None:
        responses = await asyncio.wait_for(self._stub.rpc_push(self._stream()), self.timeout)
        self._reader = asyncio.create_task(self._read_acks(responses))
        self._watchdog = asyncio.create_task(self._watch_acks())

    async def send(self, envelope: runtime_pb2.ExpertRequest, step_id: int, batch_offset: int) -> None:
        """Queue a step for the next server, waiting while the buffer is full."""
        self.open()
        if self._opening is not None:
            await self._opening
        try:
            await asyncio.wait_for(self._enqueue(envelope, (step_id, batch_offset)), self.timeout)
        except asyncio.TimeoutError:
            reason = f"no room in the push buffer for {self.timeout:g} s: the next server does not take pushes"
            await self._fail(reason)
            raise ConnectionError(f"push to {self.peer_id} failed: {reason}") from None

    async def _enqueue(self, envelope: runtime_pb2.ExpertRequest, key: tuple[int, int]) -> None:
        size = envelope.ByteSize()
        async with self._changed:
            if self._queued_bytes and self._queued_bytes + size > self.buffer_bytes:
                self.stats.waits += 1
            await self._changed.wait_for(lambda: self.failed or self._closing or not self._queued_bytes
                                         or self._queued_bytes + size <= self.buffer_bytes)
            if self.failed or self._closing:
                raise ConnectionError(f"push stream to {self.peer_id} has already failed or closed")
            self._outbox.append((envelope, size, key))
            self._queued_bytes += size
            self.stats.peak_queued_bytes = max(self.stats.peak_queued_bytes, self._queued_bytes)
            self._changed.notify_all()

    async def _stream(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        """The push stream's messages: each leaves the buffer when the stream takes it; ends on close or failure."""
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._outbox or self._closing or self.failed)
                if not self._outbox or self.failed:
                    return
                envelope, size, key = self._outbox.popleft()
                self._queued_bytes -= size
                self._arrives_by = max(time.perf_counter(), self._arrives_by) + transfer_seconds(size, self.bandwidth)
                self._sent[key] = self._arrives_by + self.timeout
                self._changed.notify_all()
            yield envelope

    async def _read_acks(self, responses: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        try:
            async for response in responses:
                message = parse_message(response.metadata, AckMessage, ErrorMessage)
                if isinstance(message, ErrorMessage):
                    await self._fail(message.error or "the next server refused a push")
                    return
                self._sent.pop((message.step_id, message.batch_offset or 0), None)
        except Exception as error:  # the stream broke: the peer died or the connection dropped
            await self._fail(f"{type(error).__name__}: {error}")
            return
        if not self._closing:
            await self._fail("the next server closed the push stream")

    async def _watch_acks(self) -> None:
        """Fail the channel when a step the stream took has gone unacknowledged for `timeout` seconds past when it should
        have arrived."""
        while not (self.failed or self._closing):
            await asyncio.sleep(min(self.timeout / 4, 0.5))
            first_due = min(self._sent.values(), default=None)
            if first_due is not None and time.perf_counter() > first_due:
                await self._fail(f"no acknowledgement within {self.timeout:g} s of the step's arrival at "
                                 f"{self.bandwidth * 8 / 1e6:g} Mbit/s")

    async def _fail(self, reason: str) -> None:
        if self.failed:
            return
        self.failed = True
        if self._closing:  # the session moved on to another next server: nobody needs to hear of it
            logger.info("Push to %s ended after close: %s", self.peer_id, reason)
        else:
            logger.warning("Push to %s failed: %s", self.peer_id, reason)
            self._on_failure(self.peer_id, reason)
        async with self._changed:  # wake senders waiting for room
            self._changed.notify_all()

    async def close(self) -> None:
        """Let the stream send what is queued, then end it."""
        async with self._changed:
            self._closing = True
            self._changed.notify_all()
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
        if self._opening is not None and self._opening.done() and not self._opening.cancelled() \
                and self._opening.exception() is not None:
            logger.info("The push stream to %s never opened: %r", self.peer_id, self._opening.exception())
        elif self._opening is not None:
            self._opening.cancel()
