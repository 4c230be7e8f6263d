"""A client's shared stream on the server: each lane served as an inference stream of its own.

The lanes' messages go to their sessions in order; the sessions' replies go back in bundles of what is ready at once
(`bloombee.protocol.bundles`). A malformed bundle is refused and ends the shared stream with every lane of it, as a
malformed frame ends a connection: which lane it meant cannot be known. Everything inside a well-formed member is
checked by the lane's session, as on a stream of its own.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from bloombee.protocol import ErrorKind
from bloombee.protocol.bundles import bundles, unbundle
from bloombee.server.backend import BAD_INPUT

logger = logging.getLogger(__name__)

Envelope = runtime_pb2.ExpertRequest
LaneHandler = Callable[[AsyncIterator[Envelope], P2PContext], AsyncIterator[Envelope]]
# seconds a stream the server refused stays open for the client to end its side after reading the error: a stream
# the server closed while the client's side was open sometimes reached the client as an end of stream without the
# error before it (about 1 in 9 runs of tests/test_rpc_fuzz.py, 1025 bad opens each)
REFUSED_STREAM_LINGER_S = 5.0
LANE_DEPTH = 4  # a lane's messages waiting for its session (a stream of its own prefetches 5)
MAX_LANES = 1024  # lanes open at once on one shared stream


class SharedStream:
    """Serves one shared stream: `serve_lane` (the inference stream handler) for each lane.

    Each lane's messages wait in a queue of their own, so that a session busy computing holds up none of the
    others; the stream is read on while fewer than LANE_DEPTH messages per open lane wait in all (as many as
    separate streams would prefetch), which bounds what a client that sends faster than its sessions compute makes
    the server hold."""

    def __init__(self, serve_lane: LaneHandler, context: P2PContext, refusal: Callable[[ErrorKind, str], Envelope]):
        self.serve_lane, self.context, self.refusal = serve_lane, context, refusal
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._lanes: dict[str, asyncio.Queue] = {}
        self._tasks: set[asyncio.Task] = set()
        self._waiting = 0  # messages delivered to lanes and not yet taken by their sessions
        self._taken = asyncio.Event()

    async def serve(self, requests: AsyncIterator[Envelope]) -> AsyncIterator[Envelope]:
        """The bundles going back to the client, while the lanes last; then the refusal of a malformed bundle if
        one ended the stream."""
        reading = asyncio.create_task(self._read(requests))
        try:
            async for reply in bundles(self._outbox):
                yield reply
            refusal = await reading
            if refusal is not None:
                yield refusal
                await until_client_ends(requests)
        finally:
            for task in (reading, *self._tasks):
                task.cancel()
            await asyncio.gather(reading, *self._tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[Envelope]) -> Envelope | None:
        """Deliver every lane's messages until the client ends the stream or sends a malformed bundle (whose
        refusal is returned, as is the error of a failure to read); then end the lanes, and the replies once they
        have."""
        refusal = None
        try:
            async for request in requests:
                for lane, message in unbundle(request):
                    await self._deliver(lane, message)
        except BAD_INPUT as error:
            refusal = self.refusal(ErrorKind.INVALID, f"malformed bundle on a shared stream: {error}")
        except Exception as error:
            logger.exception("Reading a shared stream failed")
            refusal = self.refusal(ErrorKind.INTERNAL, f"the server failed to read the shared stream: {error!r}")
        for queue in self._lanes.values():
            self._put(queue, None)
        await asyncio.gather(*self._tasks)
        self._outbox.put_nowait(None)
        return refusal

    async def _deliver(self, lane: str, message: Envelope | None) -> None:
        queue = self._lanes.get(lane)
        if queue is None:
            if message is None:  # the end of a lane that has already ended here
                return
            if len(self._lanes) >= MAX_LANES:
                self._outbox.put_nowait((lane, self.refusal(ErrorKind.REFUSED, f"a shared stream holds at most "
                                                                               f"{MAX_LANES} sessions at once")))
                self._outbox.put_nowait((lane, None))
                return
            queue = self._lanes[lane] = asyncio.Queue()
            task = asyncio.create_task(self._run_lane(lane, queue))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        while self._waiting >= LANE_DEPTH * len(self._lanes):
            self._taken.clear()
            await self._taken.wait()
        self._put(queue, message)

    def _put(self, queue: asyncio.Queue, message: Envelope | None) -> None:
        self._waiting += 1
        queue.put_nowait(message)

    async def _run_lane(self, lane: str, queue: asyncio.Queue) -> None:
        try:
            async for reply in self.serve_lane(self._messages(queue), self.context):
                self._outbox.put_nowait((lane, reply))
        except Exception:
            logger.exception("Lane %s of a shared stream failed", lane)
        finally:
            del self._lanes[lane]
            self._took(queue.qsize())  # what its session will not take
            self._outbox.put_nowait((lane, None))

    async def _messages(self, queue: asyncio.Queue) -> AsyncIterator[Envelope]:
        """A lane's messages, as its stream of its own would give them; None ends them."""
        while True:
            message = await queue.get()
            self._took(1)
            if message is None:
                return
            yield message

    def _took(self, count: int) -> None:
        self._waiting -= count
        self._taken.set()


async def until_client_ends(requests: AsyncIterator[Envelope]) -> None:
    """Wait (at most REFUSED_STREAM_LINGER_S) for the client to end its side of a stream, dropping what it sends."""
    draining = asyncio.ensure_future(_drain(requests))
    try:
        done, _ = await asyncio.wait({draining}, timeout=REFUSED_STREAM_LINGER_S)
    finally:
        draining.cancel()
    if done and draining.exception() is not None:
        logger.info("A refused stream broke before the client ended it: %r", draining.exception())


async def _drain(requests: AsyncIterator[Envelope]) -> None:
    async for _ in requests:
        pass
