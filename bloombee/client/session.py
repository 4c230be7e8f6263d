"""An inference session: one generation's stateful chain of servers, with failover by history replay."""

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Callable

import torch
from hivemind.p2p import P2P

from bloombee.client.deadlines import StepClock
from bloombee.client.figures import ChainFigures
from bloombee.client.loop import run_sync
from bloombee.client.micro_batching import MicroBatchChooser
from bloombee.client.routing import SequenceManager, Span
from bloombee.client.spans import RequestRejected, ServerFailed, SpanStream, announced_by_all
from bloombee.client.failover import ChainRepair
from bloombee.client.history import SessionHistory
from bloombee.client.steps import StepShape, StepStats, join_trees, joined, split_rows
from bloombee.client.verification import Untrusted, Verifier
from bloombee.codec import LAYOUTS, CodecError, CompressionPolicy, run_codec
from bloombee.dht.records import ServerRecord
from bloombee.planner.inputs import CLIENT
from bloombee.protocol import (
    AckMessage,
    Compaction,
    ErrorKind,
    ErrorMessage,
    Feature,
    HistoryMessage,
    Hop,
    LinearStep,
    MessageKind,
    OutputMessage,
    StepHeader,
    StepMessage,
    TreeStep,
    encode_tensors,
    envelope,
    step_rows,
    unpack_timed,
)
from bloombee.settings import ClientSettings
from bloombee.speculative.tree import PackedTrees, dense_rows

logger = logging.getLogger(__name__)


PROBE_PERIOD = 0.5  # seconds between checks, while a step is late, that the chain's servers are still connected


class InferenceSession(ChainRepair):
    """Sends steps of hidden states through the chain; each server pushes to the next, the last replies.

    The client keeps only its own inputs (the first span's history) and the shape of every step
    (bloombee.client.history). When a server fails (its stream breaks, a push to it fails, or a step outlives its
    deadline), its spans are repaired (bloombee.client.failover) and the step is retried. With verify_probability > 0,
    each span's outputs are also checked against other servers (bloombee.client.verification): at its first step,
    then at random steps; a span that loses a check is re-routed with every span after it, and the step retried.
    """

    def __init__(self, manager: SequenceManager, p2p: P2P, max_length: int, batch_size: int, hidden_size: int,
                 settings: ClientSettings, policy_for: Callable[[str, ServerRecord], CompressionPolicy], figures: ChainFigures,
                 choose_micro_batches: MicroBatchChooser, prompts: torch.Tensor | None = None):
        self.manager, self.p2p, self.settings = manager, p2p, settings
        self.prompts = prompts  # [blocks, prefix, hidden]: deep prompts, each server given its blocks' at opening
        self.choose_micro_batches = choose_micro_batches
        self.policy_for, self.figures = policy_for, figures  # the client's view of the chain's measured figures
        self.max_length, self.batch_size = max_length, batch_size
        self.position = 0
        self.streams: list[SpanStream] = []
        self.hidden_size = hidden_size
        self.history = SessionHistory(batch_size, max_length, hidden_size)
        self.recoveries = 0
        self.clock = StepClock(settings, hidden_size)
        self.last_step: StepStats | None = None
        self._step_id = 0
        self._events: asyncio.Queue | None = None
        self._closed = False
        self.verifier = Verifier(manager, p2p, settings, policy_for)
        self._tree: tuple[int, int] | None = None  # (first slot, width) of the last tree step
        self._compaction: tuple[int, list[torch.Tensor]] | None = None  # its accepted nodes, until the servers have them
        self.rows_version = 0  # reorders of the rows so far (beam search)
        self._pending_rows: torch.Tensor | None = None  # the last reorder, until a step has taken it to every server

    @property
    def spans(self) -> list[Span]:
        return [stream.span for stream in self.streams]

    # -- the synchronous API ------------------------------------------------------------------

    def open(self) -> "InferenceSession":
        run_sync(self._open())
        return self

    @property
    def tokens(self) -> int:
        """The session's size in the servers' caches: batch x max_length tokens."""
        return self.batch_size * self.max_length

    def step(self, hidden: torch.Tensor, token_mask: torch.Tensor | None = None, start_position: int | None = None) -> torch.Tensor:
        """Run `hidden` [batch, T, H] at positions [start, start + T) (default: where the last step ended)."""
        return run_sync(self._step(hidden, token_mask, start_position))

    def reorder(self, rows: torch.Tensor) -> None:
        """From the next step on, row i continues what row rows[i] held (beam search's hypotheses): the client's
        history now, the servers' caches with that step."""
        if rows.shape != (self.batch_size,) or not bool(((rows >= 0) & (rows < self.batch_size)).all()):
            raise ValueError(f"a reorder names one row of the session's {self.batch_size} per row, got {rows.tolist()}")
        lacking = [span.record.public_name or span.peer_id for span in self.spans
                   if Feature.REORDER_ROWS not in span.record.features]
        if lacking:
            raise ValueError(f"reordering rows (beam search) needs servers that announce {Feature.REORDER_ROWS.value}; "
                             f"{', '.join(lacking)} do not")
        self.history.reorder(rows, self.position)
        if self._pending_rows is None:
            self.rows_version += 1
            self._pending_rows = rows.clone()
        else:
            self._pending_rows = self._pending_rows[rows]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            run_sync(self._close_streams(self.streams))

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals, on the client loop --------------------------------------------------------

    async def _open(self) -> None:
        self._events = asyncio.Queue()
        self.streams = await self._open_route(0, self.manager.num_blocks)

    async def _open_route(self, start: int, end: int) -> list[SpanStream]:
        """Route blocks [start, end) and open a session on each server, banning unreachable ones. The servers are
        opened one after another in chain order: sessions that wait for memory then queue at every server in the
        same order, so two of them never each hold a server the other waits for."""
        loop = asyncio.get_running_loop()
        features = (Feature.BACKWARD,) if self.prompts is not None else ()
        for _ in range(self.settings.max_retries + 1):
            spans = await loop.run_in_executor(None, self.manager.make_route, start, end, self.tokens, features)
            opened, failure = await self._open_in_order(spans)
            if failure is None:
                return opened
            self.manager.hold(spans[len(opened):], self.tokens, -1)  # the span that failed and those not tried
            await self._close_streams(opened)
            stream, error = failure
            if isinstance(error, RequestRejected):
                raise error
            logger.warning("Could not open a session on %s: %r", stream.span.peer_id, error)
            self.manager.ban(stream.span.peer_id)
        raise RuntimeError(f"could not open sessions for blocks [{start}, {end}) after {self.settings.max_retries + 1} attempts")

    async def _open_in_order(self, spans: list[Span]) -> tuple[list[SpanStream], tuple[SpanStream, Exception] | None]:
        """The streams opened on `spans` in order, up to the first that failed to open (with its error), if any."""
        opened = []
        for span in spans:
            stream = SpanStream(span, self._events)
            try:
                await stream.open(self.p2p, self.max_length, self.batch_size, LAYOUTS, self.figures.link_bandwidth,
                                  self.settings.open_timeout, self.settings.compression, self.settings.active_adapter,
                                  self.prompts[span.start:span.end] if self.prompts is not None else None,
                                  self.settings.shared_streams == "on")
            except Exception as error:  # refused, unreachable or timed out: the caller decides
                return opened, (stream, error)
            opened.append(stream)
        return opened, None

    async def _close_streams(self, streams: list[SpanStream]) -> None:
        for stream in streams:
            await stream.close()
        self.manager.hold([stream.span for stream in streams], self.tokens, -1)

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    async def _step(self, hidden: torch.Tensor, token_mask: torch.Tensor | None, start_position: int | None) -> torch.Tensor:
        """The step, sent as chunks of as many positions as every server of the chain takes in one step."""
        self._check_open()
        batch, num_tokens = hidden.shape[0], hidden.shape[1]
        start = self.position if start_position is None else start_position
        if hidden.ndim != 3 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden states must have shape [batch, tokens, {self.hidden_size}], got {list(hidden.shape)}")
        if batch != self.batch_size:
            raise ValueError(f"this session was opened for batch size {self.batch_size}, got hidden states of batch {batch}")
        self._check_positions(start, num_tokens)
        mask = None if token_mask is None else token_mask.to(torch.bool).cpu()
        outputs, done = [], 0
        while not outputs or done < num_tokens:
            chunk = slice(done, done + self._chunk_positions(self.streams))
            chunk_mask = None if mask is None else mask[:, chunk]
            outputs.append(await self._linear_step(hidden[:, chunk], chunk_mask, start + done))
            done += outputs[-1].shape[1]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _chunk_positions(self, streams: Sequence[SpanStream]) -> int:
        """Positions of the whole batch that all of `streams`' servers take in one message (--max-chunk-tokens)."""
        limits = [stream.span.record.max_chunk_tokens for stream in streams
                  if stream.span.record.max_chunk_tokens is not None]
        return max(min(limits) // self.batch_size, 1) if limits else self.max_length

    async def _linear_step(self, hidden: torch.Tensor, mask: torch.Tensor | None, start: int) -> torch.Tensor:
        """One step of consecutive tokens at [start, start + T) through the chain (`mask` None: all are tokens)."""
        num_tokens = hidden.shape[1]
        self.history.write(start, hidden, mask)

        def parts_of(parts: list[tuple[int, int]]) -> list[tuple[int, dict[str, torch.Tensor]]]:
            return self._linear_parts(hidden, mask, parts)

        async def check(outputs: dict[int, dict], parts: list[tuple[int, int]]) -> None:
            self.history.record(StepShape(start, num_tokens, tuple(parts)))
            if self.verifier.enabled:
                await self._verify(start + num_tokens, joined(outputs, parts))
            self._learn_chain_figures(num_tokens, start + num_tokens)

        outputs, parts = await self._with_retries(start, num_tokens, parts_of, check, **self._rows_header())
        self._pending_rows = None
        self.position = start + num_tokens
        return joined(outputs, parts)

    def _rows_header(self) -> dict:
        """The step header's rows_version and, while a reorder is pending, the reorder."""
        pending = self._pending_rows
        return {"rows_version": self.rows_version, "reorder": None if pending is None else tuple(pending.tolist())}

    def _check_open(self) -> None:
        if self._events is None or self._closed:
            raise RuntimeError("the inference session is not open; use it inside `with model.inference_session(...)`")

    def _check_positions(self, start: int, num_tokens: int) -> None:
        if not 0 <= start <= self.position or start + num_tokens > self.max_length:
            raise ValueError(f"positions [{start}, {start + num_tokens}) do not fit this session "
                             f"(written up to {self.position}, max_length {self.max_length})")

    async def _with_retries(self, start: int, num_tokens: int, parts_of, check=None,
                            **header) -> tuple[dict[int, dict], list[tuple[int, int]]]:
        """Run a step through the chain as micro-batches (`parts_of(parts)` gives each one's tensors) and then
        `check(outputs, parts)` if given, re-routing failed servers and retrying: the outputs by micro-batch and
        the parts."""
        for attempt in range(self.settings.max_retries + 1):
            parts = split_rows(self.batch_size, self.micro_batches_for(self.streams, num_tokens, start + num_tokens))
            try:
                outputs = await self._run_chain(self.streams, parts_of(parts), start, True, num_tokens, **header)
                if check is not None:
                    await check(outputs, parts)
                self._compaction = None
                return outputs, parts
            except ServerFailed as failure:
                await self._after_failure(failure, attempt, start)
        raise AssertionError("unreachable")

    def _linear_parts(self, hidden: torch.Tensor, mask: torch.Tensor | None,
                      parts: Sequence[tuple[int, int]]) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Each micro-batch's tensors of a step of consecutive tokens (`mask` None: all are tokens)."""
        result = []
        for offset, size in parts:
            rows = None if mask is None else mask[offset:offset + size]
            step = LinearStep(hidden[offset:offset + size], None if rows is None or bool(rows.all()) else rows)
            result.append((offset, step.tensors()))
        return result

    # -- tree steps (speculative decoding) ----------------------------------------------------------

    def supports_tree_steps(self) -> bool:
        return announced_by_all(self.streams, Feature.TREE_STEPS)

    def tree_step(self, hidden: torch.Tensor, trees: PackedTrees, prune_tau: float | None = None
                  ) -> tuple[torch.Tensor, PackedTrees]:
        """Run each row's token tree (`hidden` [sum of the trees' nodes, H], packed like `trees`) from the current
        position: the chain's outputs of the nodes the first server kept, packed, and their trees."""
        return run_sync(self._tree_step(hidden, trees, prune_tau))

    def commit_tree(self, accepted: list[torch.Tensor]) -> int:
        """Keep each row's accepted nodes (ids, root first) of the last tree step; the position advances by the
        longest. The servers compact their caches when the next step arrives. Returns the new position."""
        start, width = self._tree
        keep = [ids.to(torch.long) for ids in accepted]
        # servers computing a tree's nodes as the same tokens decoded one at a time: replays repeat them one at a time
        advance = self.history.commit_tree(start, width, keep, announced_by_all(self.streams, Feature.EXACT_TREES))
        self._compaction = (start, keep)
        self.position = start + advance
        return self.position

    async def _tree_step(self, hidden: torch.Tensor, trees: PackedTrees, prune_tau: float | None
                         ) -> tuple[torch.Tensor, PackedTrees]:
        self._check_open()
        if trees.num_rows != self.batch_size or hidden.ndim != 2 or hidden.shape != (trees.parents.numel(), self.hidden_size):
            raise ValueError(f"a tree step takes {self.batch_size} trees and their nodes' hidden states "
                             f"[nodes, {self.hidden_size}], got {trees.num_rows} trees and {list(hidden.shape)}")
        if int(trees.offsets[0]) != 0 or int(trees.offsets[-1]) != trees.parents.numel():  # else nodes would be cut off
            raise ValueError(f"tree offsets must run from 0 to the {trees.parents.numel()} nodes given, "
                             f"got {trees.offsets.tolist()[:16]}")
        if not self.supports_tree_steps():
            raise RuntimeError(f"a server of this chain does not announce tree steps "
                               f"(feature {Feature.TREE_STEPS.value!r})")
        start, width = self.position, max(trees.counts)
        self._check_positions(start, width)
        self.history.write(start, dense_rows(hidden, trees.offsets, width), dense_rows(
            torch.ones(hidden.shape[0], dtype=torch.bool), trees.offsets, width))

        def parts_of(parts: list[tuple[int, int]]) -> list[tuple[int, dict[str, torch.Tensor]]]:
            return [(offset, TreeStep(hidden[int(trees.offsets[offset]):int(trees.offsets[offset + size])],
                                      trees.select(offset, size)).tensors()) for offset, size in parts]

        outputs, parts = await self._with_retries(start, width, parts_of, prune_tau=prune_tau)
        self._tree = (start, width)
        kept = join_trees([TreeStep.from_tensors(outputs[offset]).trees for offset, _ in parts])
        return joined(outputs, parts), kept

    async def _verify(self, end: int, output: torch.Tensor) -> None:
        """Check the spans due at this step, which ended at `end` with `output` (bloombee.client.verification); raise
        Untrusted for the first one that loses its check: every span after it computed on its outputs."""
        histories: dict[int, torch.Tensor] = {}
        for index in [index for index, stream in enumerate(self.streams) if self.verifier.due(stream)]:
            inputs = self.history.inputs[:, :end] if index == 0 else await self._history_of(histories, index - 1, end)
            claimed = await self._history_of(histories, index, end)
            if index == len(self.streams) - 1:
                claimed = claimed.clone()
                claimed[:, end - output.shape[1]:end] = output
            if not await self.verifier.check(self.streams[index], inputs, claimed, self.history.mask[:, :end]):
                span = self.streams[index].span
                raise Untrusted(index, f"its outputs for blocks [{span.start}, {span.end}) lost a verification")

    async def _history_of(self, histories: dict[int, torch.Tensor], index: int, end: int) -> torch.Tensor:
        """Span `index`'s output history over [0, end), fetched once per step."""
        if index not in histories:
            try:
                histories[index] = await self._fetch_history(self.streams[index], end)
            except ServerFailed as error:
                raise ServerFailed(index, str(error), error.ban) from error
        return histories[index]

    async def _run_chain(self, chain: list[SpanStream], parts: list[tuple[int, dict[str, torch.Tensor]]], start: int,
                         reply: bool, num_tokens: int, **header) -> dict[int, dict[str, torch.Tensor]]:
        """Send one step's micro-batches (first row, tensors) to the first server of `chain`; gather the last server's
        outputs (tensors by first row), or its acknowledgements."""
        began = time.perf_counter()
        step_id = self._next_step_id()
        stats = StepStats(micro_batches=len(parts))
        expected = self.clock.expected([stream.span for stream in chain], self.batch_size, num_tokens)
        await self._send_step(chain, step_id, start, parts, reply, stats, **header)
        outputs = await self._await(chain, step_id, MessageKind.OUTPUT if reply else MessageKind.ACK, expected, stats,
                                    [offset for offset, _ in parts])
        stats.total_s = time.perf_counter() - began
        self.last_step = stats
        if reply:
            self.clock.observe(self.batch_size, num_tokens, stats.total_s)
            self.figures.observe_step([stream.span.peer_id for stream in chain], stats)
        return outputs

    async def _send_step(self, chain: list[SpanStream], step_id: int, start: int,
                         parts: Sequence[tuple[int, dict[str, torch.Tensor]]], reply: bool, stats: StepStats,
                         **header) -> None:
        """Encode and send one step's micro-batches to the first server of `chain`, with the rest of the chain, and
        the accepted nodes of the last tree while the servers have not had them."""
        message_bytes = max(tensor.nbytes for tensor in parts[0][1].values())  # the hidden states every server sends on
        route = tuple(Hop(peer_id=stream.span.peer_id, session_id=stream.session_id, codecs=stream.span.record.codecs,
                          link_bandwidth=stream.span.record.link_bandwidth,
                          decode_speed=self.figures.decode_speed(stream.span.peer_id, message_bytes))
                      for stream in chain[1:])
        if reply and self._compaction is not None:
            header["compact_start"] = self._compaction[0]
        header = StepHeader(session_id=chain[0].session_id, step_id=step_id, start_position=start, route=route, reply=reply,
                            reply_decode_speed=self.figures.decode_speed(CLIENT, message_bytes), **header)
        for offset, tensors in parts:
            if header.compact_start is not None:
                rows = self._compaction[1][offset:offset + step_rows(tensors)]
                tensors = {**tensors, **Compaction.of(rows).tensors()}
            num_bytes = sum(tensor.nbytes for tensor in tensors.values())
            encoded = await run_codec(None, num_bytes, encode_tensors, tensors, self._policy(chain[0]))
            step = header.model_copy(update={"batch_offset": offset})
            await chain[0].send(envelope(StepMessage(step=step), encoded.frames))
            stats.add_sent(offset, encoded)

    def planned_micro_batches(self, chain: list[SpanStream], num_tokens: int) -> int | None:
        """The M of the plan every server of `chain` follows, for the decode steps of the batch size it planned."""
        plans = {(s.span.record.planned_batch_size, s.span.record.planned_micro_batches) for s in chain}
        if len(plans) != 1 or num_tokens != 1:
            return None
        batch, micro_batches = plans.pop()
        return micro_batches if batch == self.batch_size else None

    def micro_batches_for(self, chain: list[SpanStream], num_tokens: int, context: int) -> int:
        """How many micro-batches a step of `num_tokens` tokens per row (over `context` cached ones) goes in."""
        if self.batch_size == 1 or not announced_by_all(chain, Feature.MICRO_BATCHES):
            return 1
        wanted = self.settings.micro_batches
        if wanted == "auto":
            wanted = self.planned_micro_batches(chain, num_tokens) or self.choose_micro_batches(
                [stream.span for stream in chain], self.batch_size, num_tokens, context)
        return max(1, min(int(wanted), self.batch_size))

    def predicted_step_s(self, num_tokens: int) -> float | None:
        """The planner's time for a step of `num_tokens` tokens per row through the chain (None without profiles)."""
        context = self.position + num_tokens
        return self.choose_micro_batches.step_seconds(self.spans, self.batch_size, num_tokens, context,
                                                      self.micro_batches_for(self.streams, num_tokens, context))

    def _learn_chain_figures(self, num_tokens: int, context: int) -> None:
        """Each server's report of the last step times its compute: feed that to the planner's model of the chain (its
        codec's figures reach the client's view at every step: `ChainFigures.observe_step`)."""
        reports = self.last_step.reports
        if len(reports) == len(self.streams) and all(stream.span.record.profile for stream in self.streams):
            self.choose_micro_batches.observe(self.spans, self.batch_size, num_tokens, context, self.last_step)

    def _policy(self, stream: SpanStream) -> CompressionPolicy:
        return self.policy_for(stream.span.peer_id, stream.span.record)

    async def _await(self, chain: list[SpanStream], step_id: int, want: MessageKind, expected: float,
                     stats: StepStats | None = None, offsets: Sequence[int] = (0,),
                     earlier: frozenset[int] = frozenset()) -> dict[int, dict[str, torch.Tensor]]:
        """Wait for message `want` of `step_id` from the last server of `chain`, one per micro-batch (keyed by its
        first row, in any order), for at most the deadline of something `expected` to take that many seconds; raise
        ServerFailed on any failure, of this step or of the steps `earlier` still in flight."""
        loop = asyncio.get_running_loop()
        timeout = self.clock.deadline(expected)
        deadline = loop.time() + timeout
        probe_at = loop.time() + max(self.settings.step_timeout_factor * expected, PROBE_PERIOD)
        acked: set[int] = set()
        pending, outputs = set(offsets), {}
        while True:
            try:
                stream, item = await asyncio.wait_for(self._events.get(), max(min(deadline, probe_at) - loop.time(), 0))
            except asyncio.TimeoutError:
                if loop.time() >= deadline:
                    silent = next((index for index in range(len(chain)) if index not in acked), len(chain) - 1)
                    raise ServerFailed(silent, f"no answer within {timeout:.1f} s (expected {expected:.2f} s)") from None
                await self._check_connected(chain)
                probe_at = loop.time() + PROBE_PERIOD
                continue
            if stream not in chain:
                continue
            index = chain.index(stream)
            if isinstance(item, BaseException):
                raise ServerFailed(index, f"stream lost: {item!r}")
            received = time.perf_counter()
            try:
                message, tensors, decode_cpu_s = unpack_timed(item)
            except (CodecError, ValueError) as error:
                raise ServerFailed(index, f"sent a malformed message: {error}") from error
            if not isinstance(message, ErrorMessage | OutputMessage | AckMessage | HistoryMessage):
                continue  # not about a step
            if message.step_id not in (None, step_id) and message.step_id not in earlier:
                continue
            if isinstance(message, ErrorMessage):
                self._raise_error(chain, index, message)
                continue
            if message.step_id != step_id:
                continue
            if isinstance(message, AckMessage):
                acked.add(index)
            offset = message.batch_offset or 0
            if message.kind == want and index == len(chain) - 1 and offset in pending:
                pending.discard(offset)
                outputs[offset] = tensors
                if stats is not None:
                    stats.add_received(message.reports, time.perf_counter() - received, decode_cpu_s,
                                       sum(len(frame.buffer) for frame in item.tensors))
                if not pending:
                    return outputs

    async def _check_connected(self, chain: list[SpanStream]) -> None:
        """Raise ServerFailed for the first server of `chain` this client has lost its connection to (its p2p daemon
        ended: a dead server, found before the step's deadline; a frozen one stays connected until then)."""
        try:
            peers = await asyncio.wait_for(self.p2p.list_peers(), PROBE_PERIOD)
        except asyncio.TimeoutError:
            logger.warning("This client's p2p daemon did not list its connections within %g s", PROBE_PERIOD)
            return
        connected = {info.peer_id.to_base58() for info in peers}
        for index, stream in enumerate(chain):
            if stream.span.peer_id not in connected:
                raise ServerFailed(index, "its connection closed (the server's p2p daemon ended)")

    @staticmethod
    def _raise_error(chain: list[SpanStream], index: int, message: ErrorMessage) -> None:
        """Raise what an error message from server `index` means; return for a report about a server no longer in
        the chain (a push of an earlier chain that failed after the session moved on)."""
        name = chain[index].span.record.public_name or chain[index].span.peer_id
        if message.error_kind == ErrorKind.INVALID:
            raise RequestRejected(f"server {name} rejected the request: {message.error}")
        if message.error_kind == ErrorKind.PEER_FAILED:
            peers = [stream.span.peer_id for stream in chain]
            if message.failed_peer is not None and message.failed_peer not in peers:
                logger.info("Ignoring a report from %s about %s, no longer in the chain: %s", name, message.failed_peer,
                            message.error)
                return
            failed = peers.index(message.failed_peer) if message.failed_peer in peers else min(index + 1, len(chain) - 1)
            raise ServerFailed(failed, message.error or "push failed")
        raise ServerFailed(index, f"server {name}: {message.error}", ban=message.error_kind != ErrorKind.EXPIRED)
