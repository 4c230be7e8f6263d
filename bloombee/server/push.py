"""A server's outgoing push stream to the next server of a session's chain."""

import asyncio
import logging
import time
from typing import AsyncIterator, Callable

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from bloombee.codec import CompressionPolicy
from bloombee.protocol import Message, MessageKind
from bloombee.protocol.service import block_service_stub
from bloombee.protocol.streams import queue_stream

logger = logging.getLogger(__name__)


class PushChannel:
    """Keeps one push stream to (peer, session) open and reports a failure through `on_failure` once."""

    def __init__(self, p2p: P2P, peer_id: str, session_id: str,
                 on_failure: Callable[[str, str], None], policy: CompressionPolicy):
        self.peer_id, self.session_id, self.policy = peer_id, session_id, policy
        self._sent: dict[int, tuple[float, int]] = {}  # step id -> (send time, wire bytes), until acked
        self._stub = block_service_stub(p2p, peer_id)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._on_failure = on_failure
        self._reader: asyncio.Task | None = None
        self._closing = False
        self.failed = False

    async def send(self, envelope: runtime_pb2.ExpertRequest, step_id: int, wire_bytes: int) -> None:
        """Queue a step for the next server; its ack times the transfer for the link's bandwidth estimate."""
        if self.failed:
            raise ConnectionError(f"push stream to {self.peer_id} has already failed")
        if self._reader is None:
            responses = await self._stub.rpc_push(queue_stream(self._outbox))
            self._reader = asyncio.create_task(self._read_acks(responses))
        self._sent[step_id] = (time.perf_counter(), wire_bytes)
        await self._outbox.put(envelope)

    async def _read_acks(self, responses: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        try:
            async for response in responses:
                message = Message.model_validate_json(response.metadata)
                if message.kind == MessageKind.ERROR:
                    self._fail(message.error or "the next server refused a push")
                    return
                sent_at, wire_bytes = self._sent.pop(message.step_id, (None, 0))
                if sent_at is not None:
                    self.policy.observe_transfer(wire_bytes, time.perf_counter() - sent_at)
        except Exception as error:  # the stream broke: the peer died or the connection dropped
            self._fail(f"{type(error).__name__}: {error}")
            return
        if not self._closing:
            self._fail("the next server closed the push stream")

    def _fail(self, reason: str) -> None:
        if not self.failed:
            self.failed = True
            logger.warning("Push to %s failed: %s", self.peer_id, reason)
            self._on_failure(self.peer_id, reason)

    async def close(self) -> None:
        self._closing = True
        await self._outbox.put(None)
        if self._reader is not None:
            self._reader.cancel()
