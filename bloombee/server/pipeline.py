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

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from hivemind.proto import runtime_pb2

from bloombee.protocol import (
    ErrorKind,
    HopReport,
    Message,
    MessageKind,
    StepHeader,
    encode_tensors,
    envelope,
    error_envelope,
    pack,
    unpack_timed,
)
from bloombee.server.backend import BAD_INPUT, InvalidStep
from bloombee.server.sessions import Session
from bloombee.speculative.tree import COMPACT_TENSORS, TREE_TENSORS, PackedTrees, check_offsets, unpack_rows

if TYPE_CHECKING:
    from bloombee.server.handler import BlockServicer

logger = logging.getLogger(__name__)

Envelope = runtime_pb2.ExpertRequest
STAGE_DEPTH = 2  # items waiting between two stages
REMEMBERED_STEPS = 4096  # (step id, batch offset) keys kept per session to recognise a step that comes again
STEP_TENSORS = ("hidden", "token_mask", "rope_positions") + TREE_TENSORS + COMPACT_TENSORS  # what a step may carry
_END = object()


@dataclass
class DecodedStep:
    header: StepHeader
    tensors: dict[str, torch.Tensor]
    decode_at: float
    decode_s: float
    decode_cpu_s: float


@dataclass
class ComputedStep:
    header: StepHeader
    sent_on: dict[str, torch.Tensor]
    report: HopReport


class SessionPipeline:
    """Runs one session's messages through the three stages; `responses()` yields what goes back to the client."""

    def __init__(self, servicer: BlockServicer, session: Session):
        self.servicer, self.session = servicer, session
        self.decoded: asyncio.Queue = asyncio.Queue(STAGE_DEPTH)
        self.computed: asyncio.Queue = asyncio.Queue(STAGE_DEPTH)
        self.replies: asyncio.Queue = asyncio.Queue()
        self.applied: OrderedDict[tuple[int, int], None] = OrderedDict()
        # (time.time() it began, seconds, CPU seconds) of the last step's work in the compute thread
        self._computed = (0.0, 0.0, 0.0)

    def notify(self, message: Message) -> None:
        """Send a message to the client out of band (a failed push reported by the push channel)."""
        self.replies.put_nowait(pack(message))

    async def responses(self) -> AsyncIterator[Envelope]:
        stages = [asyncio.create_task(self._guarded(stage))
                  for stage in (self._decode_stage, self._compute_stage, self._send_stage)]
        try:
            while True:
                reply = await self.replies.get()
                if reply is _END:
                    return
                yield reply
        finally:
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
        self.replies.put_nowait(error_envelope(kind, text, step_id))

    # -- stage 1: receive and decode ---------------------------------------------------------

    async def _decode_stage(self) -> None:
        timeout = self.servicer.settings.session_timeout
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

    async def _decode(self, item: Envelope) -> DecodedStep | Message | None:
        step_id = None
        try:
            message = Message.model_validate_json(item.metadata)
            step_id = message.step_id if message.step is None else message.step.step_id
            if message.kind == MessageKind.HISTORY:
                return message
            if message.kind != MessageKind.STEP or message.step is None:
                raise InvalidStep(f"expected a step or history message, got {message.kind.value!r}")
            if message.step.session_id != self.session.session_id:
                raise InvalidStep(f"the step names session {message.step.session_id[:128]!r}, not this stream's session")
            if message.step.route and self.session.push_channel is None:
                await self.servicer.open_push(self.session, message.step.route[0], self.notify)
            began, decode_at = time.perf_counter(), time.time()
            _, tensors, cpu_s = await self.servicer.run_codec(unpack_timed, item, self.servicer.max_request_bytes,
                                                              STEP_TENSORS)
            if "hidden" not in tensors:
                raise InvalidStep("a step needs a 'hidden' tensor")
            return DecodedStep(message.step, tensors, decode_at, time.perf_counter() - began, cpu_s)
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
            if isinstance(item, Message):
                await self._answer_history(item)
                continue
            computed = await self._compute(item)
            if computed is not None:
                await self.computed.put(computed)

    async def _answer_history(self, message: Message) -> None:
        try:
            reply = await self.servicer.run_compute(self.servicer.history_envelope, self.session, message)
        except BAD_INPUT as error:
            self._error(ErrorKind.INVALID, str(error), message.step_id)
            return
        self.replies.put_nowait(reply)

    async def _compute(self, step: DecodedStep) -> ComputedStep | None:
        header, tensors = step.header, step.tensors
        key = (header.step_id, header.batch_offset)
        duplicate = key in self.applied
        try:
            self._computed = (time.time(), 0.0, 0.0)
            compaction = None if header.compact_start is None else (header.compact_start, compact_ids(tensors))
            if "tree_parents" in tensors:
                header, sent_on = await self._tree_step(header, tensors, duplicate, compaction)
            else:
                sent_on = {"hidden": await self._linear_step(header, tensors, duplicate, compaction)}
                if header.route:
                    sent_on.update({name: tensors[name] for name in ("token_mask", "rope_positions") if name in tensors})
            self._remember(key)
            compute_at, compute_s, compute_cpu_s = self._computed
        except BAD_INPUT as error:
            self._error(ErrorKind.INVALID, str(error), header.step_id)
            return None
        except Exception as error:
            logger.exception("Step %s of session %s failed", header.step_id, self.session.session_id)
            self._error(ErrorKind.INTERNAL, f"{type(error).__name__}: {error}", header.step_id)
            return None
        if header.route and header.compact_start is not None:
            sent_on.update({name: tensors[name] for name in COMPACT_TENSORS})
        report = HopReport(peer_id=self.servicer.peer_id, decode_s=step.decode_s, decode_cpu_s=step.decode_cpu_s,
                           compute_s=compute_s, compute_cpu_s=compute_cpu_s,
                           batch_offset=header.batch_offset, decode_at=step.decode_at, compute_at=compute_at,
                           duplicate=duplicate, nodes=sent_on["hidden"].shape[0] if "tree_ids" in sent_on else 0)
        return ComputedStep(header, sent_on, report)

    async def _linear_step(self, header: StepHeader, tensors: dict[str, torch.Tensor], duplicate: bool,
                           compaction: tuple[int, list[torch.Tensor]] | None) -> torch.Tensor:
        """A step of consecutive tokens; one that came before is not computed again."""
        step_args = (header.start_position, header.batch_offset, tensors.get("token_mask"), tensors.get("rope_positions"))
        if duplicate:
            if compaction is not None:
                await self.servicer.run_compute(self._compact, header, compaction)
            self.servicer.backend.check_step(self.session, tensors["hidden"], *step_args)
            return self._earlier_output(header, tensors["hidden"])
        return await self.servicer.run_compute(self._after_compaction, header, compaction, self._timed_step,
                                               tensors["hidden"], *step_args)

    async def _tree_step(self, header: StepHeader, tensors: dict[str, torch.Tensor], duplicate: bool,
                         compaction: tuple[int, list[torch.Tensor]] | None) -> tuple[StepHeader, dict]:
        """A step of token trees; the header sent on, without the pruning threshold once this server pruned, and the
        outputs with their trees. One that comes again while its trees are still held is computed again (it writes
        the same slots); once they are compacted it is refused, as writing it would undo the compaction."""
        trees = PackedTrees.from_tensors(tensors)
        rows = range(header.batch_offset, header.batch_offset + trees.num_rows)
        if duplicate and any(self.session.trees.get(row, (None,))[0] != header.start_position for row in rows):
            raise InvalidStep(f"tree step {header.step_id} came again after its trees were compacted")
        out, kept = await self.servicer.run_compute(self._after_compaction, header, compaction,
                                                    self.servicer.backend.tree_step, self.session, tensors["hidden"],
                                                    header.start_position, header.batch_offset, trees, header.prune_tau)
        if kept is not trees:
            header = header.model_copy(update={"prune_tau": None})
            logger.debug("Session %s: pruned %d tree nodes to %d", self.session.session_id, trees.parents.numel(),
                         kept.parents.numel())
        return header, {"hidden": out, **kept.tensors()}

    def _after_compaction(self, header: StepHeader, compaction: tuple[int, list[torch.Tensor]] | None, fn, *args):
        """In the compute thread: the previous tree's compaction, if the step carries one, then `fn(*args)`; so the
        step never reads a cache that is not yet compacted. When and how long it ran is what the hop report says
        the step computed (the hand-over to and from the compute thread is not)."""
        began_at, began, began_cpu = time.time(), time.perf_counter(), time.thread_time()
        if compaction is not None:
            self._compact(header, compaction)
        result = fn(*args)
        self._computed = (began_at, time.perf_counter() - began, time.thread_time() - began_cpu)
        return result

    def _compact(self, header: StepHeader, compaction: tuple[int, list[torch.Tensor]]) -> None:
        self.servicer.backend.compact(self.session, compaction[0], header.batch_offset, compaction[1])

    def _timed_step(self, hidden: torch.Tensor, *step_args) -> torch.Tensor:
        """The backend's step (in the compute thread), its compute time counted towards the announced throughput."""
        began = time.perf_counter()
        out = self.servicer.backend.step(self.session, hidden, *step_args)
        blocks = self.session.end_block - self.session.start_block
        self.servicer.meter.observe(hidden.shape[0], hidden.shape[1], blocks, time.perf_counter() - began)
        return out

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
        header, report = step.header, step.report
        next_hop = header.route[0] if header.route else None
        if next_hop is None and not header.reply:
            self.replies.put_nowait(self._ack(header, header.reports + (report,)))
            return
        servicer = self.servicer
        num_bytes = max(tensor.nbytes for tensor in step.sent_on.values())  # the hidden states
        policy = (servicer.push_policy(self.session, next_hop, num_bytes) if next_hop
                  else servicer.reply_policy(self.session, header.reply_decode_speed, num_bytes))
        encode_at = time.time()
        encoded = await servicer.run_codec(encode_tensors, step.sent_on, policy)
        report = report.model_copy(update=dict(layout=encoded.layout, raw_bytes=encoded.raw_bytes, encode_at=encode_at,
                                               wire_bytes=encoded.wire_bytes, encode_s=encoded.seconds))
        reports = header.reports + (report,)
        if next_hop is None:
            reply = Message(kind=MessageKind.OUTPUT, step_id=header.step_id, batch_offset=header.batch_offset, reports=reports)
            self.replies.put_nowait(envelope(reply, encoded.frames))
            return
        failure = await servicer.push(self.session, header.model_copy(update={"reports": reports}), encoded, self.notify)
        self.replies.put_nowait(failure if failure is not None else self._ack(header, (report,)))

    @staticmethod
    def _ack(header: StepHeader, reports: tuple[HopReport, ...]) -> Envelope:
        return pack(Message(kind=MessageKind.ACK, step_id=header.step_id, batch_offset=header.batch_offset, reports=reports))


def compact_ids(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The accepted node ids of each row a step's compaction names; InvalidStep if its tensors are malformed."""
    if any(name not in tensors for name in COMPACT_TENSORS):
        raise InvalidStep(f"a step with compact_start carries {list(COMPACT_TENSORS)}")
    ids, offsets = tensors["compact_ids"], tensors["compact_offsets"]
    if ids.ndim != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise InvalidStep(f"compact_ids must be a 1-d integer tensor, got {ids.dtype} {list(ids.shape)}")
    check_offsets(offsets, ids.numel())
    return unpack_rows(ids, offsets)
