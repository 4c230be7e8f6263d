"""One open inference stream from the client to one server of the chain."""

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import AsyncIterator

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from bloombee.client.readers import track_reader
from bloombee.client.routing import Span
from bloombee.client.shared_streams import SharedStream, open_lane
from bloombee.protocol import ErrorKind, ErrorMessage, Feature, OpenMessage, OpenSession, pack, parse_message
from bloombee.protocol.service import block_service_stub
from bloombee.protocol.streams import queue_stream

logger = logging.getLogger(__name__)


class ServerFailed(Exception):
    """A server of the chain failed (died, dropped the stream, timed out, could not push) or expired our session."""

    def __init__(self, index: int, reason: str, ban: bool = True):
        super().__init__(reason)
        self.index, self.ban = index, ban


class RequestRejected(ValueError):
    """A server rejected the request itself (bad input or over its limits): retrying elsewhere will not help."""


class SpanStream:
    """Holds the stream of one span's session and feeds every response into the session's event queue."""

    def __init__(self, span: Span, events: asyncio.Queue):
        self.span, self.events = span, events
        self.session_id = uuid.uuid4().hex
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._shared: SharedStream | None = None  # the shared stream this session's stream is a lane of, if any
        self._reader: asyncio.Task | None = None

    async def open(self, p2p: P2P, max_length: int, batch_size: int, codecs: tuple[str, ...], link_bandwidth: float,
                   timeout: float, compression: str = "auto", adapter: str | None = None,
                   prompts: torch.Tensor | None = None, shared: bool = True) -> None:
        """Open the session (computing LoRA `adapter`, None: the base model; with the span's deep `prompts`
        [blocks, prefix, hidden] if given); raises RequestRejected when the server refuses it, ConnectionError when
        unreachable. A `compression` of "on" or "off" asks the server to send this session's outputs so, where it
        announces that. With `shared`, the session's stream is a lane of this client's shared stream to the server
        where it announces them (bloombee.client.shared_streams)."""
        announced = Feature.SESSION_COMPRESSION in self.span.record.features
        asked = compression if compression != "auto" and announced else None
        request = OpenSession(session_id=self.session_id, start_block=self.span.start, end_block=self.span.end,
                              max_length=max_length, batch_size=batch_size, codecs=codecs, link_bandwidth=link_bandwidth,
                              compression=asked, adapter=adapter)
        opening = pack(OpenMessage(open=request), {"prompts": prompts} if prompts is not None else None)
        if shared and Feature.SHARED_STREAMS in self.span.record.features:
            self._shared, responses = await open_lane(p2p, self.span.peer_id, self.session_id, timeout)
        else:
            stub = block_service_stub(p2p, self.span.peer_id)
            responses = await asyncio.wait_for(stub.rpc_inference(queue_stream(self._outbox)), timeout)
        await self.send(opening)
        try:
            await self._opened(await asyncio.wait_for(anext(aiter(responses), None), timeout))
        except BaseException:
            await self.close()
            raise
        self._reader = asyncio.create_task(self._read(responses))
        track_reader(p2p, self._reader)

    async def _opened(self, first: runtime_pb2.ExpertRequest | None) -> None:
        """Raise unless the server's first reply says it opened the session."""
        if first is None:
            raise ConnectionError(f"server {self.span.peer_id} closed the stream before opening a session")
        reply = parse_message(first.metadata)
        if isinstance(reply, ErrorMessage):
            name = self.span.record.public_name or self.span.peer_id
            if reply.error_kind in (ErrorKind.INVALID, ErrorKind.REFUSED):
                raise RequestRejected(f"server {name} refused the session: {reply.error}")
            raise ConnectionError(f"server {name} failed to open a session: {reply.error}")

    async def _read(self, responses: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        try:
            async for envelope in responses:
                await self.events.put((self, envelope))
        except asyncio.CancelledError:  # closed, or its client stopped reading: a step still waiting fails over
            self.events.put_nowait((self, ConnectionError(f"the client stopped reading its stream to server "
                                                          f"{self.span.peer_id}")))
            raise
        except Exception as error:  # the stream broke; the session decides what to do
            await self.events.put((self, error))
            return
        await self.events.put((self, ConnectionError(f"server {self.span.peer_id} closed the stream")))

    async def send(self, envelope: runtime_pb2.ExpertRequest) -> None:
        if self._shared is not None:
            self._shared.send(self.session_id, envelope)
        else:
            await self._outbox.put(envelope)

    async def close(self) -> None:
        if self._shared is not None:
            self._shared.send(self.session_id, None)
        else:
            await self._outbox.put(None)
        if self._reader is not None:
            self._reader.cancel()


def announced_by_all(chain: Sequence[SpanStream], feature: Feature) -> bool:
    """Whether every server of `chain` announces `feature`."""
    return all(feature in stream.span.record.features for stream in chain)
