"""Failover of an inference session: re-route a failed server's blocks and replay their inputs onto the new servers."""

import logging

import torch

from bloombee.client.spans import ServerFailed, SpanStream
from bloombee.client.steps import StepStats
from bloombee.client.verification import Untrusted
from bloombee.protocol import HistoryMessage, MessageKind, pack

logger = logging.getLogger(__name__)


class ChainRepair:
    """InferenceSession's failover (a mixin: it uses the session's streams, history, routing and step transport).

    The spans a failed server covered are routed to other servers, which are given the history of their inputs
    (from the client, or from the previous server's output history) step by step in the recorded shapes, so that
    their caches are rebuilt bit for bit."""

    async def _after_failure(self, failure: ServerFailed, attempt: int, start: int) -> None:
        if attempt == self.settings.max_retries:
            raise RuntimeError(f"step failed after {attempt + 1} attempts: {failure}") from failure
        logger.warning("Server %s failed (%s); re-routing its blocks", self.streams[failure.index].span.peer_id, failure)
        through = len(self.streams) - 1 if isinstance(failure, Untrusted) else failure.index
        await self._recover(failure.index, start, ban=failure.ban, through=through)

    async def _recover(self, failed: int, history_end: int, ban: bool = True, through: int | None = None) -> None:
        """Replace the failed span (through span `through`, default itself, and earlier ones whose history is lost)
        and rebuild their caches."""
        self.recoveries += 1
        if ban:
            self.manager.ban(self.streams[failed].span.peer_id)
        first, last = failed, failed if through is None else through
        while True:
            start_block, end_block = self.streams[first].span.start, self.streams[last].span.end
            await self._close_streams(self.streams[first:last + 1])
            new_streams = await self._open_route(start_block, end_block)
            if history_end == 0:
                break
            if first == 0:
                inputs = self.history.inputs[:, :history_end]
            else:
                try:
                    inputs = await self._fetch_history(self.streams[first - 1], history_end)
                except ServerFailed as error:
                    logger.warning("Previous server %s lost too (%s)", self.streams[first - 1].span.peer_id, error)
                    self.manager.ban(self.streams[first - 1].span.peer_id)
                    await self._close_streams(new_streams)
                    first -= 1
                    continue
            try:
                await self._replay(new_streams, inputs, history_end)
                break
            except ServerFailed as error:
                logger.warning("Replay onto new servers failed (%s); routing again", error)
                self.manager.ban(new_streams[error.index].span.peer_id)
                await self._close_streams(new_streams)
        self.streams[first:last + 1] = new_streams
        logger.info("Recovered: chain is now %s", [(s.span.peer_id[-6:], s.span.start, s.span.end) for s in self.streams])

    async def _replay(self, chain: list[SpanStream], inputs: torch.Tensor, end: int) -> None:
        """Rebuild the caches of `chain` over positions [0, end) from its `inputs`, in the recorded step shapes; all
        steps are sent at once and the last one's acknowledgement closes the replay."""
        shapes = self.history.shapes_before(end)
        spans = [stream.span for stream in chain]
        expected = sum(self.clock.expected(spans, self.batch_size, shape.tokens) for shape in shapes)
        stats, step_ids = StepStats(), []
        for shape in shapes:
            step_ids.append(self._next_step_id())
            positions = slice(shape.start, shape.start + shape.tokens)
            await self._send_step(chain, step_ids[-1], shape.start, self._linear_parts(
                inputs[:, positions], self.history.mask[:, positions], shape.parts), False, stats,
                rows_version=self.rows_version)
        await self._await(chain, step_ids[-1], MessageKind.ACK, expected, offsets=[offset for offset, _ in shapes[-1].parts],
                          earlier=frozenset(step_ids[:-1]))
        logger.info("Replayed %d positions onto %s as %d steps", end, [span.peer_id[-6:] for span in spans], len(shapes))

    async def _fetch_history(self, stream: SpanStream, end: int) -> torch.Tensor:
        """The server's outputs for positions [0, end), fetched in chunks of its --max-chunk-tokens."""
        per_message = self._chunk_positions([stream])
        parts = []
        for start in range(0, end, per_message):
            step_id, stop = self._next_step_id(), min(start + per_message, end)
            await stream.send(pack(HistoryMessage(start_position=start, end_position=stop, step_id=step_id,
                                                  **self._rows_header())))
            expected = self.clock.announced([stream.span], self.batch_size * (stop - start))
            parts.append((await self._await([stream], step_id, MessageKind.HISTORY, expected))[0]["hidden"])
        return torch.cat(parts, dim=1)
