"""One session's step pipeline: decode, compute and encode + send run as three concurrent stages.

Messages (client steps, pushes from the previous server, history requests) go through

    inbox -> [decode] -> decoded -> [compute] -> computed -> [encode + push or reply] -> replies

Each stage is an asyncio task; decoding and encoding run in the server's codec thread, compute in
its compute thread (shared by all sessions, one micro-batch at a time). The queues between stages
are bounded, so a slow next server (whose push stream stops draining) slows this server down
instead of growing its memory. Items keep their arrival order through every stage. A step is
keyed by (step id, batch offset): one that arrives again is not computed again; its output is
taken from the output history and sent on as before.
"""

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import torch
from hivemind.proto import runtime_pb2

from bloombee.codec import CompressionPolicy
from bloombee.protocol import (
    STEP_TENSORS,
    AckMessage,
    Compaction,
    EncodedTensors,
    ErrorKind,
    HistoryMessage,
    Hop,
    HopReport,
    InvalidStep,
    LinearStep,
    Message,
    OutputMessage,
    Step,
    StepHeader,
    StepMessage,
    TreeStep,
    encode_tensors,
    envelope,
    pack,
    parse_message,
    parse_step,
    unpack_timed,
)
from bloombee.server.backend import BAD_INPUT, BlockBackend, PreparedStep, error_reply
from bloombee.server.batching import StepBatcher
from bloombee.server.metrics import ServerMetrics
from bloombee.server.sessions import Session

logger = logging.getLogger(__name__)

Envelope = runtime_pb2.ExpertRequest
Notify = Callable[[Message], None]
STAGE_DEPTH = 2  # items waiting between two stages
REMEMBERED_STEPS = 4096  # (step id, batch offset) keys kept per session to recognise a step that comes again
_END = object()


@dataclass(frozen=True)
class PipelineContext:
    """What a session's pipeline takes from its server: the blocks, the threads, the limits and the links."""

    backend: BlockBackend
    batcher: StepBatcher  # forwards of the steps of all sessions ready at once
    peer_id: str
    session_timeout: float
    max_request_bytes: int
    run_compute: Callable[..., Awaitable]  # fn, *args in the compute thread
    run_codec: Callable[..., Awaitable]  # num_bytes, fn, *args: in the codec thread where it is worth it
    open_push: Callable[[Session, Hop, Notify], Awaitable[None]]
    push: Callable[[Session, StepHeader, EncodedTensors, Notify], Awaitable[Envelope | None]]
    push_policy: Callable[[Session, Hop, int], CompressionPolicy]
    reply_policy: Callable[[Session, float | None, int], CompressionPolicy]
    metrics: ServerMetrics


@dataclass
class DecodedStep:
    header: StepHeader
    step: Step
    compaction: Compaction | None
    decode_at: float
    decode_s: float
    decode_cpu_s: float


@dataclass
class ComputedStep:
    header: StepHeader
    sent_on: dict[str, torch.Tensor]
    report: dict  # HopReport's fields so far (the encode adds its own)


class SessionPipeline:
    """Runs one session's messages through the three stages; `responses()` yields what goes back to the client."""

    def __init__(self, context: PipelineContext, session: Session):
        self.context, self.session = context, session
        self.decoded: asyncio.Queue = asyncio.Queue(STAGE_DEPTH)
        self.computed: asyncio.Queue = asyncio.Queue(STAGE_DEPTH)
        self.replies: asyncio.Queue = asyncio.Queue()
        self.applied: OrderedDict[tuple[int, int], None] = OrderedDict()
        # (time.time() it began, seconds, CPU seconds) of the last step's forward in the compute thread
        self._computed = (0.0, 0.0, 0.0)

    def notify(self, message: Message) -> None:
        """Send a message to the client out of band (a failed push reported by the push channel)."""
        self.replies.put_nowait(pack(message))

    async def responses(self) -> AsyncIterator[Envelope]:
        self.context.batcher.opened(self.session.session_id)
        stages = [asyncio.create_task(self._guarded(stage))
                  for stage in (self._decode_stage, self._compute_stage, self._send_stage)]
        try:
            while True:
                reply = await self.replies.get()
                if reply is _END:
                    return
                yield reply
        finally:
            self.context.batcher.forget(self.session.session_id)
            for task in stages:
                task.cancel()
            await asyncio.gather(*stages, return_exceptions=True)

    async def _guarded(self, stage) -> None:
        """Run a stage; if it fails unexpectedly, tell the client and end the session rather than hang it."""
        try:
            await stage()
        except Exception as error:
            logger.exception("Session %s: its step pipeline failed", self.session.session_id)
            self._error(ErrorKind.INTERNAL, f"the server's step pipeline failed: {type(error).__name__}: {error}", None)
            self.replies.put_nowait(_END)

    def _error(self, kind: ErrorKind, text: str, step_id: int | None) -> None:
        self.replies.put_nowait(self.context.metrics.refusal(kind, text, step_id))

    # -- stage 1: receive and decode ---------------------------------------------------------

    async def _decode_stage(self) -> None:
        timeout = self.context.session_timeout
        while True:
            try:
                item = await asyncio.wait_for(self.session.inbox.get(), timeout=timeout)
            except asyncio.TimeoutError:
                self._error(ErrorKind.EXPIRED, f"session idle for over {timeout:g} s; its cache was freed", None)
                await self.decoded.put(_END)
                return
            if item is None:
                await self.decoded.put(_END)
                return
            self.session.last_active = time.monotonic()
            decoded = await self._decode(item)
            if decoded is not None:
                await self.decoded.put(decoded)

    async def _decode(self, item: Envelope) -> DecodedStep | HistoryMessage | None:
        step_id = None
        try:
            message = parse_message(item.metadata, StepMessage, HistoryMessage)
            if isinstance(message, HistoryMessage):
                return message
            header = message.step
            step_id = header.step_id
            if header.session_id != self.session.session_id:
                raise InvalidStep(f"the step names session {header.session_id[:128]!r}, not this stream's session")
            if header.route and self.session.push_channel is None:
                await self.context.open_push(self.session, header.route[0], self.notify)
            began, decode_at = time.perf_counter(), time.time()
            num_bytes = sum(len(frame.buffer) for frame in item.tensors)
            self.context.metrics.bytes_in.inc(num_bytes)
            _, tensors, cpu_s = await self.context.run_codec(num_bytes, unpack_timed, item,
                                                             self.context.max_request_bytes, STEP_TENSORS)
            step, compaction = parse_step(tensors, header.compact_start is not None)
            return DecodedStep(header, step, compaction, decode_at, time.perf_counter() - began, cpu_s)
        except BAD_INPUT as error:
            self._error(ErrorKind.INVALID, str(error), step_id)
            return None

    # -- stage 2: compute ---------------------------------------------------------------------

    async def _compute_stage(self) -> None:
        while True:
            item = await self.decoded.get()
            if item is _END:
                await self.computed.put(_END)
                return
            if isinstance(item, HistoryMessage):
                await self._answer_history(item)
                continue
            computed = await self._compute(item)
            if computed is not None:
                await self.computed.put(computed)

    async def _answer_history(self, message: HistoryMessage) -> None:
        try:
            reply = await self.context.run_compute(self._history_envelope, message)
        except BAD_INPUT as error:
            self._error(ErrorKind.INVALID, str(error), message.step_id)
            return
        self.replies.put_nowait(reply)

    def _history_envelope(self, message: HistoryMessage) -> Envelope:
        """This server's outputs for positions [start_position, end_position) of every row (for a replacement of the
        next server)."""
        start, end, session = message.start_position, message.end_position, self.session
        if not start <= end <= session.max_length:
            raise InvalidStep(f"history positions must be [start, end) within [0, {session.max_length}], got "
                              f"[{start}, {end})")
        history = session.output_history[:, start:end]
        rows = self.context.backend.rows_towards(session, message.rows_version, message.reorder)
        if rows is not None:  # the step that reorders has not reached this server yet
            history = history[rows]
        reply = HistoryMessage(start_position=start, end_position=end, step_id=message.step_id,
                               rows_version=message.rows_version)
        return pack(reply, {"hidden": history}, self.context.reply_policy(session, None, 0))

    async def _compute(self, decoded: DecodedStep) -> ComputedStep | None:
        header, step = decoded.header, decoded.step
        key = (header.step_id, header.batch_offset)
        duplicate = key in self.applied
        try:
            self._computed = (time.time(), 0.0, 0.0)
            if isinstance(step, TreeStep):
                header, sent_on = await self._tree_step(header, step, duplicate, decoded.compaction)
            else:
                sent_on = await self._linear_step(header, step, duplicate, decoded.compaction)
            self._remember(key)
            compute_at, compute_s, compute_cpu_s = self._computed
            if not duplicate:
                self.context.metrics.step_seconds.observe(compute_s)
        except Exception as error:
            self._failed(header, error)
            return None
        sent = sent_on.tensors()
        if header.route and decoded.compaction is not None:
            sent.update(decoded.compaction.tensors())
        report = dict(peer_id=self.context.peer_id, decode_s=decoded.decode_s, decode_cpu_s=decoded.decode_cpu_s,
                      compute_s=compute_s, compute_cpu_s=compute_cpu_s,
                      batch_offset=header.batch_offset, decode_at=decoded.decode_at, compute_at=compute_at,
                      duplicate=duplicate, nodes=sent_on.hidden.shape[0] if isinstance(sent_on, TreeStep) else 0)
        return ComputedStep(header, sent, report)

    def _failed(self, header: StepHeader, error: Exception) -> None:
        """Tell the client a step failed: its fault (INVALID) or this server's (INTERNAL, logged)."""
        kind, text = error_reply(error)
        if kind == ErrorKind.INTERNAL:
            logger.error("Step %s of session %s failed", header.step_id, self.session.session_id, exc_info=error)
        self._error(kind, text, header.step_id)

    async def _linear_step(self, header: StepHeader, step: LinearStep, duplicate: bool,
                           compaction: Compaction | None) -> LinearStep:
        """A step of consecutive tokens, its output as sent on; one that came before is not computed again."""
        step_args = (header.start_position, header.batch_offset, step.token_mask, step.rope_positions)
        self.context.backend.check_chunk(step.hidden)
        if header.rows_version != self.session.rows_version:
            await self.context.run_compute(self.context.backend.follow_rows, self.session, header.rows_version,
                                           header.reorder, header.start_position)
        if duplicate:
            if compaction is not None:
                await self.context.run_compute(self._compact, header, compaction)
            self.context.backend.check_step(self.session, step.hidden, *step_args)
            out = self._earlier_output(header, step.hidden)
        else:
            def prepare() -> PreparedStep:
                if compaction is not None:
                    self._compact(header, compaction)
                return self.context.backend.prepare_step(self.session, step.hidden, *step_args)

            out = await self._batched(header, step.hidden.shape[0], step.hidden.shape[:2].numel(), prepare)
        return LinearStep(out, step.token_mask, step.rope_positions) if header.route else LinearStep(out)

    async def _tree_step(self, header: StepHeader, step: TreeStep, duplicate: bool,
                         compaction: Compaction | None) -> tuple[StepHeader, TreeStep]:
        """A step of token trees; the header sent on, without the pruning threshold once this server pruned, and the
        outputs with their trees. One that comes again while its trees are still held is computed again (it writes
        the same slots); once they are compacted it is refused, as writing it would undo the compaction."""
        trees = step.trees
        rows = range(header.batch_offset, header.batch_offset + trees.num_rows)
        if duplicate and any(self.session.trees.get(row, (None,))[0] != header.start_position for row in rows):
            raise InvalidStep(f"tree step {header.step_id} came again after its trees were compacted")

        def prepare() -> PreparedStep:
            if compaction is not None:
                self._compact(header, compaction)
            return self.context.backend.prepare_tree_step(self.session, step.hidden, header.start_position,
                                                          header.batch_offset, trees, header.prune_tau)

        out, kept = await self._batched(header, trees.num_rows, step.hidden.shape[0], prepare)
        if kept is not trees:
            header = header.model_copy(update={"prune_tau": None})
            logger.debug("Session %s: pruned %d tree nodes to %d", self.session.session_id, trees.parents.numel(),
                         kept.parents.numel())
        return header, TreeStep(out, kept)

    async def _batched(self, header: StepHeader, rows: int, vectors: int, prepare):
        """The step `prepare()` makes (after the previous tree's compaction if the step carries one, so that it never
        reads a cache not yet compacted), computed in a forward with other sessions' steps ready at once; that
        forward's time is what the hop report says the step computed."""
        session = self.session
        whole_chain = not header.route and not header.reports  # no other server computes this session's steps
        result, timing = await self.context.batcher.compute(session.session_id,
                                                           (session.start_block, session.end_block), rows, vectors,
                                                           prepare, session.adapter, whole_chain)
        self._computed = (timing.began_at, timing.seconds, timing.cpu_seconds)
        return result

    def _compact(self, header: StepHeader, compaction: Compaction) -> None:
        self.context.backend.compact(self.session, header.compact_start, header.batch_offset, compaction.rows())

    def _earlier_output(self, header: StepHeader, hidden: torch.Tensor) -> torch.Tensor:
        """The output this session computed when the step first came (its rows and positions of the history)."""
        rows = slice(header.batch_offset, header.batch_offset + hidden.shape[0])
        positions = slice(header.start_position, header.start_position + hidden.shape[1])
        logger.info("Step %s (rows from %d) of session %s came again; sending the earlier output",
                    header.step_id, header.batch_offset, self.session.session_id)
        return self.session.output_history[rows, positions].clone()

    def _remember(self, key: tuple[int, int]) -> None:
        self.applied[key] = None
        if len(self.applied) > REMEMBERED_STEPS:
            self.applied.popitem(last=False)

    # -- stage 3: encode and send on ----------------------------------------------------------

    async def _send_stage(self) -> None:
        while True:
            item = await self.computed.get()
            if item is _END:
                self.replies.put_nowait(_END)
                return
            await self._send(item)

    async def _send(self, step: ComputedStep) -> None:
        header = step.header
        next_hop = header.route[0] if header.route else None
        if next_hop is None and not header.reply:
            self.replies.put_nowait(self._ack(header, header.reports + (_report(step.report),)))
            return
        context = self.context
        num_bytes = max(tensor.nbytes for tensor in step.sent_on.values())  # the hidden states
        policy = (context.push_policy(self.session, next_hop, num_bytes) if next_hop
                  else context.reply_policy(self.session, header.reply_decode_speed, num_bytes))
        encode_at = time.time()
        encoded = await context.run_codec(num_bytes, encode_tensors, step.sent_on, policy)
        report = _report(step.report, layout=encoded.layout, raw_bytes=encoded.raw_bytes, encode_at=encode_at,
                         wire_bytes=encoded.wire_bytes, encode_s=encoded.seconds)
        reports = header.reports + (report,)
        self.context.metrics.bytes_out.inc(encoded.wire_bytes)
        if next_hop is None:
            reply = OutputMessage.model_construct(step_id=header.step_id, batch_offset=header.batch_offset,
                                                  reports=reports)
            self.replies.put_nowait(envelope(reply, encoded.frames))
            return
        failure = await context.push(self.session, header.model_copy(update={"reports": reports}), encoded, self.notify)
        self.replies.put_nowait(failure if failure is not None else self._ack(header, (report,)))

    @staticmethod
    def _ack(header: StepHeader, reports: tuple[HopReport, ...]) -> Envelope:
        return pack(AckMessage.model_construct(step_id=header.step_id, batch_offset=header.batch_offset, reports=reports))


def _report(fields: dict, **encoded) -> HopReport:
    """This server's report of a step, from values it made itself (so not validated again: a step's hot path)."""
    return HopReport.model_construct(**fields, **encoded)

