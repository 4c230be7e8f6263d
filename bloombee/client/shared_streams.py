"""The client's shared streams: one per server, carrying its sessions there as lanes (bloombee.protocol.bundles).

A shared stream opens with the first lane to a server and ends with the last; while one is open, sessions opening
on that server take a lane of it. When it breaks, every lane ends with the error, and each session repairs its chain
as it would for a stream of its own.
"""

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from bloombee.client.readers import track_reader
from bloombee.protocol import ErrorMessage, parse_message
from bloombee.protocol.bundles import BUNDLE, bundles, unbundle
from bloombee.protocol.service import block_service_stub
from bloombee.protocol.streams import queue_stream

logger = logging.getLogger(__name__)

Envelope = runtime_pb2.ExpertRequest
# per P2P instance (a client), its open shared streams by server peer id
_OPEN: weakref.WeakKeyDictionary[P2P, dict[str, "SharedStream"]] = weakref.WeakKeyDictionary()


class SharedStream:
    """One shared stream to the server `peer_id`; `lane` gives a session's replies, `send` its messages."""

    def __init__(self, peer_id: str, streams: dict[str, "SharedStream"]):
        self.peer_id, self._streams = peer_id, streams
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._lanes: dict[str, asyncio.Queue] = {}
        self._started: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self.ended = False

    async def start(self, p2p: P2P, timeout: float) -> None:
        """Open the stream, once: callers while it opens wait for the same opening."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._open(p2p, timeout))
        try:
            await asyncio.shield(self._started)
        except Exception:
            self._end()
            raise

    async def _open(self, p2p: P2P, timeout: float) -> None:
        stub = block_service_stub(p2p, self.peer_id)
        responses = await asyncio.wait_for(stub.rpc_sessions(bundles(self._outbox)), timeout)
        self._reader = asyncio.create_task(self._read(responses))
        track_reader(p2p, self._reader)  # a stream whose last lane closed is read until the server ends it too

    def lane(self, lane: str) -> AsyncIterator[Envelope]:
        """Open lane `lane`: the replies to what is sent on it, until the server ends it or the stream breaks (raising
        the error)."""
        queue = self._lanes[lane] = asyncio.Queue()
        return queue_stream(queue)

    def send(self, lane: str, message: Envelope | None) -> None:
        """Send `message` on `lane`; None ends the lane (and the stream with the last lane). On a stream that has
        broken, nothing is sent: the lane has been given the error already."""
        if self._reader is not None and self._reader.done():
            return
        self._outbox.put_nowait((lane, message))
        if message is None:
            self._lanes.pop(lane, None)
            if not self._lanes:
                self._end()
                self._outbox.put_nowait(None)

    async def _read(self, responses: AsyncIterator[Envelope]) -> None:
        error: Exception = ConnectionError(f"server {self.peer_id} closed the shared stream")
        try:
            async for reply in responses:
                if reply.uid != BUNDLE:
                    raise ConnectionError(f"server {self.peer_id} ended the shared stream: "
                                          f"{parse_message(reply.metadata, ErrorMessage).error}")
                for lane, message in unbundle(reply):
                    self._deliver(lane, message)
        except asyncio.CancelledError:
            error = ConnectionError(f"the client stopped reading its shared stream to server {self.peer_id}")
            raise
        except Exception as broken:  # every lane's session decides what to do
            error = broken
        finally:
            self._end()
            for queue in self._lanes.values():
                queue.put_nowait(error)
            self._lanes.clear()

    def _deliver(self, lane: str, message: Envelope | None) -> None:
        queue = self._lanes.get(lane)
        if queue is None:  # a lane its session has ended: what the server still sent on it is not awaited
            return
        if message is None:
            del self._lanes[lane]
        queue.put_nowait(message)

    def _end(self) -> None:
        """No new lane opens on this stream any more."""
        self.ended = True
        if self._streams.get(self.peer_id) is self:
            del self._streams[self.peer_id]


async def open_lane(p2p: P2P, peer_id: str, lane: str, timeout: float) -> tuple[SharedStream, AsyncIterator[Envelope]]:
    """A lane named `lane` on this client's shared stream to `peer_id` (opened if none is), and its replies."""
    streams = _OPEN.setdefault(p2p, {})
    while True:  # again only if the stream found ended (its last lane closed) while this waited for it to open
        created = peer_id not in streams
        if created:
            streams[peer_id] = SharedStream(peer_id, streams)
        stream = streams[peer_id]
        await stream.start(p2p, timeout)
        if not stream.ended:
            return stream, stream.lane(lane)
        if created:
            raise ConnectionError(f"server {peer_id} ended the shared stream as it opened")
