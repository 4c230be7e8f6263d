"""The block server's RPCs: inference streams, pushes from the previous server, stateless forward, info."""

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from bloombee import codec
from bloombee.codec import CompressionPolicy, run_codec
from bloombee.protocol import (
    STEP_TENSORS,
    AckMessage,
    BackwardMessage,
    EncodedTensors,
    ErrorKind,
    ErrorMessage,
    ForwardMessage,
    Hop,
    InfoMessage,
    InvalidStep,
    LinearStep,
    Message,
    OpenedMessage,
    OpenMessage,
    OutputMessage,
    StepHeader,
    StepMessage,
    pack,
    parse_message,
    step_kind,
    unpack,
)
from bloombee.protocol import envelope as envelope_of
from bloombee.protocol.service import register_block_service
from bloombee.server.backend import BAD_INPUT, BlockBackend, error_reply
from bloombee.server.batching import BatchLimits, ForwardTiming, StepBatcher
from bloombee.server.pipeline import PipelineContext, SessionPipeline
from bloombee.server.push import PushChannel, PushStats
from bloombee.server.memory import SessionRefused
from bloombee.server.metrics import ServerMetrics
from bloombee.server.sessions import Session, SessionRegistry
from bloombee.server.shared_streams import SharedStream, until_client_ends
from bloombee.server.throughput import ThroughputMeter
from bloombee.server.training import KeptForward, KeptForwards
from bloombee.settings import ServerSettings

logger = logging.getLogger(__name__)

Envelope = runtime_pb2.ExpertRequest


class BlockServicer:
    """Serves one block range; one instance per server process, registered on the server's P2P."""

    def __init__(self, backend: BlockBackend, registry: SessionRegistry, settings: ServerSettings, info: Callable[[], dict],
                 link_bandwidth: float, meter: ThroughputMeter, metrics: ServerMetrics):
        self.backend, self.registry, self.settings, self._info = backend, registry, settings, info
        self.meter = meter  # the announced throughput, refreshed from the steps served
        self.metrics = metrics
        self.link_bandwidth = link_bandwidth
        self._policies: dict[str, CompressionPolicy] = {}
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bloombee-compute")
        limits = BatchLimits(settings.max_batch_rows, settings.max_batch_tokens, settings.batch_wait_ms / 1e3)
        self.batcher = StepBatcher(backend, self.run_compute, limits, self._predicted_forward_seconds,
                                   self._forward_done)
        self.codec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bloombee-codec")
        self.push_stats = PushStats()
        self.kept_forwards = KeptForwards(settings.kept_forward_bytes, settings.kept_forward_timeout)
        self.p2p: P2P | None = None
        self.peer_id = ""
        self.sessions_served = 0
        # the most tensor bytes one request may carry: a [max batch, max length] window of float64 hidden states,
        # plus its token mask and rope positions
        self.max_request_bytes = settings.max_batch_size * settings.max_length * 8 * (backend.hidden_size + 2)

    def _predicted_forward_seconds(self, vectors: int, blocks: int) -> float:
        """By the current meter's figures (a server that moves its blocks gets a new meter)."""
        return self.meter.forward_seconds(vectors, blocks)

    def _forward_done(self, timing: ForwardTiming) -> None:
        """A forward of sessions' steps ran: it feeds the announced throughput and the metrics."""
        self.meter.observe(timing.vectors, timing.blocks, timing.seconds, timing.steps)
        self.metrics.observe_forward(timing.vectors, timing.steps)

    async def start(self, p2p: P2P) -> None:
        self.p2p, self.peer_id = p2p, p2p.peer_id.to_base58()
        await register_block_service(p2p, self)

    async def rpc_info(self, request: Envelope, context: P2PContext) -> Envelope:
        try:
            parse_message(request.metadata, InfoMessage)
            if request.tensors:
                raise InvalidStep("an info request carries no tensors")
        except BAD_INPUT as error:
            return self.metrics.refusal(ErrorKind.INVALID, f"malformed info request: {error}")
        return pack(InfoMessage(info=self._info()))

    async def rpc_forward(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        peer = context.remote_id.to_base58()
        async for request in requests:
            try:
                message, tensors = unpack(request, self.max_request_bytes, ("hidden", "token_mask", "prompts"))
                self._check_forward(message, tensors)
                hidden, token_mask, prompts = tensors["hidden"], tensors.get("token_mask"), tensors.get("prompts")
                out = await self.run_compute(self.backend.forward, hidden, message.start_block, message.end_block,
                                             token_mask, prompts, message.adapter)
                if message.forward_id is not None:
                    self.kept_forwards.keep(message.forward_id, KeptForward(
                        peer, message.start_block, message.end_block, hidden, token_mask, prompts, message.adapter))
                yield pack(OutputMessage(), {"hidden": out}, self._policy(peer, self.link_bandwidth, message.codecs or ()))
            except Exception as error:
                yield self._refusal(error, "A forward request failed")

    async def rpc_backward(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        peer = context.remote_id.to_base58()
        async for request in requests:
            try:
                message, tensors = unpack(request, self.max_request_bytes, ("grad_outputs",))
                if not isinstance(message, BackwardMessage) or "grad_outputs" not in tensors:
                    raise InvalidStep("a backward request is a message of kind 'backward' with a 'grad_outputs' tensor")
                kept = self.kept_forwards.find(message.forward_id, peer)
                grad_inputs, grad_prompts = await self.run_compute(
                    self.backend.backward, kept.hidden, kept.start_block, kept.end_block, kept.token_mask,
                    kept.prompts, tensors["grad_outputs"], kept.adapter)
                self.kept_forwards.forget(message.forward_id)
                grads = {"grad_inputs": grad_inputs} if grad_prompts is None else {"grad_inputs": grad_inputs,
                                                                                  "grad_prompts": grad_prompts}
                yield pack(OutputMessage(), grads, self._policy(peer, self.link_bandwidth, message.codecs or ()))
            except Exception as error:
                yield self._refusal(error, "A backward request failed")

    def _refusal(self, error: Exception, what: str) -> Envelope:
        """The error reply to a failed forward or backward (`error_reply`); an internal failure is logged."""
        kind, text = error_reply(error)
        if kind == ErrorKind.INTERNAL:
            logger.exception(what)
        return self.metrics.refusal(kind, text)

    def _check_forward(self, message: Message, tensors: dict[str, torch.Tensor]) -> None:
        """Raise InvalidStep unless a forward request is one, with hidden states, within this server's length limits:
        a row as long as a session's, as many tokens in all as the largest session holds."""
        if not isinstance(message, ForwardMessage):
            raise InvalidStep(f"a forward request is a message of kind 'forward', not {message.kind.value!r}")
        if "hidden" not in tensors:
            raise InvalidStep("a forward request needs a 'hidden' tensor")
        shape, max_length = tensors["hidden"].shape, self.settings.max_length
        if len(shape) == 3 and (shape[1] > max_length or shape[0] * shape[1] > self.settings.max_batch_size * max_length):
            raise InvalidStep(f"a forward of shape {list(shape)} is over this server's limits: {max_length} tokens a row, "
                              f"{self.settings.max_batch_size * max_length} in all")

    async def rpc_push(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        async for request in requests:
            try:
                session, header = self._check_push(request)
            except BAD_INPUT as error:
                yield self.metrics.refusal(ErrorKind.INVALID, f"malformed push: {error}")
                continue
            try:
                await asyncio.wait_for(session.inbox.put(request), self.settings.push_timeout)
            except asyncio.TimeoutError:
                yield self.metrics.refusal(ErrorKind.REFUSED, f"session {header.session_id} took no push for "
                                           f"{self.settings.push_timeout:g} s", header.step_id)
                continue
            yield pack(AckMessage(step_id=header.step_id, batch_offset=header.batch_offset))

    def _check_push(self, request: Envelope) -> tuple[Session, StepHeader]:
        """The session a pushed step goes to and its header, once the header and the frames' headers and checksums fit
        that session (the pusher hears of a bad push, not the session's client); raises a BAD_INPUT error if not."""
        header = parse_message(request.metadata, StepMessage).step
        session = self.registry.get(header.session_id)
        if session is None:
            raise InvalidStep(f"session {header.session_id[:128]!r} is not open on this server")
        frames = {proto.dtype: codec.inspect(proto.buffer, max_bytes=self.max_request_bytes) for proto in request.tensors}
        if set(frames) - set(STEP_TENSORS) or len(frames) != len(request.tensors):
            raise InvalidStep(f"a pushed step carries some of {list(STEP_TENSORS)}, each once")
        if sum(frame.raw_bytes for frame in frames.values()) > self.max_request_bytes:
            raise InvalidStep(f"a pushed step may carry at most {self.max_request_bytes} bytes of tensors")
        if step_kind(frames, header.compact_start is not None) is not LinearStep:
            return session, header  # a tree step's shapes depend on its trees' values: checked when it is computed
        step = LinearStep.from_tensors({name: torch.empty(frame.shape, dtype=frame.dtype, device="meta")
                                        for name, frame in frames.items()})
        self.backend.check_step(session, step.hidden, header.start_position, header.batch_offset, step.token_mask,
                                step.rope_positions)
        return session, header

    async def rpc_sessions(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        async for reply in SharedStream(self.rpc_inference, context, self.metrics.refusal).serve(requests):
            yield reply

    async def rpc_inference(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        first = await anext(aiter(requests), None)
        if first is None:
            return
        try:
            session = await self._open_session(first, context.remote_id.to_base58())
        except BAD_INPUT as error:
            yield self.metrics.refusal(ErrorKind.INVALID, str(error))
            await until_client_ends(requests)
            return
        except SessionRefused as error:
            yield self.metrics.refusal(ErrorKind.REFUSED, str(error))
            await until_client_ends(requests)
            return
        self.sessions_served += 1
        pump = asyncio.create_task(self._pump(requests, session))
        pipeline = SessionPipeline(self._pipeline_context(), session)
        try:
            yield pack(OpenedMessage(info={"device_free_bytes": self.registry.budget.free.device,
                                           "host_free_bytes": self.registry.budget.free.host}))
            async for response in pipeline.responses():
                yield response
        finally:
            pump.cancel()
            await self._close_push(session)
            self.registry.remove(session)

    def _pipeline_context(self) -> PipelineContext:
        return PipelineContext(self.backend, self.batcher, self.peer_id, self.settings.session_timeout,
                               self.max_request_bytes, self.run_compute, self.run_codec, self.open_push, self.push,
                               self.push_policy, self.reply_policy, self.metrics)

    async def _open_session(self, envelope: Envelope, client_peer: str) -> Session:
        message, tensors = unpack(envelope, self.max_request_bytes, ("prompts",))
        if not isinstance(message, OpenMessage):
            raise InvalidStep("the first message of an inference stream must open a session")
        request = message.open
        self.backend.check_range(request.start_block, request.end_block)
        if request.batch_size > self.settings.max_batch_size:
            raise SessionRefused(f"batch size {request.batch_size} is over this server's limit of {self.settings.max_batch_size}")
        if request.max_length > self.settings.max_length:
            raise SessionRefused(f"max_length {request.max_length} is over this server's limit of {self.settings.max_length}")
        self.backend.adapters.check(request.adapter)
        need = self.backend.session_bytes(request.start_block, request.end_block, request.batch_size, request.max_length)
        await self.registry.budget.reserve(need, self.settings.alloc_timeout)
        try:
            session = self.backend.new_session(
                request.session_id, request.start_block, request.end_block, request.batch_size, request.max_length,
                reply_codecs=request.codecs, client_peer=client_peer, client_bandwidth=request.link_bandwidth,
                compression=request.compression, adapter=request.adapter, prompts=tensors.get("prompts"))
            self.registry.add(session)
        except BaseException:
            self.registry.budget.release(need)
            raise
        logger.info("Opened session %s: blocks [%d, %d), batch %d, max_length %d, holding %s", session.session_id,
                    session.start_block, session.end_block, session.batch_size, session.max_length, need)
        return session

    @staticmethod
    async def _pump(requests: AsyncIterator[Envelope], session: Session) -> None:
        """Move the client's messages into the session's inbox, where pushes also arrive; None marks the end."""
        try:
            async for request in requests:
                await session.inbox.put(request)
        except Exception as error:  # the client's stream broke: the session ends as if it had closed it
            logger.info("Session %s: the client's stream broke (%r)", session.session_id, error)
        await session.inbox.put(None)

    def push_policy(self, session: Session, hop: Hop, num_bytes: int) -> CompressionPolicy:
        """The policy of the link to the next server, about to send it `num_bytes`."""
        return self._policy(hop.peer_id, self.hop_bandwidth(hop), hop.codecs, session.compression, hop.decode_speed,
                            num_bytes)

    def hop_bandwidth(self, hop: Hop) -> float:
        """Bytes/s to the next server: the slower of this server's link and the one it announced."""
        return min(self.link_bandwidth, hop.link_bandwidth or self.link_bandwidth)

    def reply_policy(self, session: Session, client_decode_speed: float | None = None,
                     num_bytes: int = 0) -> CompressionPolicy:
        """The policy of the link to the session's client, about to send it `num_bytes`."""
        bandwidth = min(self.link_bandwidth, session.client_bandwidth or self.link_bandwidth)
        return self._policy(session.client_peer, bandwidth, session.reply_codecs, session.compression,
                            client_decode_speed, num_bytes)

    def _policy(self, peer_id: str, bandwidth: float, accepted: tuple[str, ...], mode: str | None = None,
                decode_speed: float | None = None, num_bytes: int = 0) -> CompressionPolicy:
        """One compression policy per link (peer) and mode (the session's, else this server's), refined by what this
        server observes on it and by the receiver's decode speed of messages of `num_bytes` when the step carries
        it."""
        mode = mode or self.settings.compression
        key = peer_id if mode == self.settings.compression else f"{peer_id} ({mode})"
        if key not in self._policies:
            self._policies[key] = CompressionPolicy(mode, link_bandwidth=bandwidth, accepted=accepted or ("raw",))
        if decode_speed is not None:
            self._policies[key].adopt_decompress_speed(decode_speed, num_bytes)
        return self._policies[key]

    def link_reports(self) -> dict[str, dict]:
        """Per peer this server sends to: its compression policy's last decision, estimates and counts."""
        return {peer_id: policy.report() for peer_id, policy in self._policies.items()}

    async def push(self, session: Session, header: StepHeader, encoded: EncodedTensors,
                   notify: Callable[[Message], None]) -> Envelope | None:
        """Send a step on to the next server of its route; an error envelope for the client if that fails."""
        hop: Hop = header.route[0]
        channel = await self._channel(session, hop, notify)
        next_header = header.model_copy(update={"session_id": hop.session_id, "route": header.route[1:]})
        try:
            await channel.send(envelope_of(StepMessage(step=next_header), encoded.frames),
                               header.step_id, header.batch_offset)
        except Exception as error:
            return self.metrics.refusal(ErrorKind.PEER_FAILED, f"could not push to {hop.peer_id}: {error}",
                                        header.step_id, hop.peer_id)
        return None

    async def open_push(self, session: Session, hop: Hop, notify: Callable[[Message], None]) -> None:
        """Open the push stream of a session's first step to its next server while this server decodes and computes
        the step."""
        (await self._channel(session, hop, notify)).open()

    async def _channel(self, session: Session, hop: Hop, notify: Callable[[Message], None]) -> PushChannel:
        channel: PushChannel | None = session.push_channel
        if channel is not None and (channel.peer_id, channel.session_id) == (hop.peer_id, hop.session_id) and not channel.failed:
            return channel
        if channel is not None:
            await channel.close()

        def report(peer_id: str, reason: str) -> None:
            notify(ErrorMessage(error_kind=ErrorKind.PEER_FAILED, error=f"push to {peer_id} failed: {reason}",
                                failed_peer=peer_id))

        session.push_channel = PushChannel(self.p2p, hop.peer_id, hop.session_id, report, self.settings.push_buffer_bytes,
                                           self.push_stats, self.settings.push_timeout, self.hop_bandwidth(hop))
        return session.push_channel

    @staticmethod
    async def _close_push(session: Session) -> None:
        if session.push_channel is not None:
            await session.push_channel.close()

    async def run_compute(self, fn, *args):
        """Run `fn` in the compute thread (one per server: sessions take turns on the device)."""
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    async def run_codec(self, num_bytes: int, fn, *args):
        """Run `fn` (a decode or an encode of `num_bytes`) in the codec thread, beside the compute (a small one right
        here: `codec.run_codec`)."""
        return await run_codec(self.codec, num_bytes, fn, *args)
