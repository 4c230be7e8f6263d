"""Optional verification of untrusted servers: a span's outputs recomputed by other servers holding its blocks.

A check of span S at a step ending at position `end` compares S's outputs over positions [0, end) (its output
history; for the last span, the step's positions come from the reply the client used) with a stateless forward of
S's inputs over [0, end) (the client's inputs, or the previous span's output history) through blocks
[S.start, S.end) on another server. Two opinions agree when every real token's hidden state is within the
dtype's tolerance. On disagreement a third server, where there is one, referees: a server is trusted only if
another opinion agrees with it, so with three the odd one out is banned and with two both are (which of the two
lies cannot be told).
"""

import asyncio
import logging
import random
import weakref

import torch
from hivemind.p2p import P2P

from bloombee.client.routing import SequenceManager, Span
from bloombee.client.spans import RequestRejected, ServerFailed, SpanStream
from bloombee.client.stateless import forward_span
from bloombee.dht.records import ServerRecord
from bloombee.settings import ClientSettings

logger = logging.getLogger(__name__)
FORWARD_ATTEMPTS = 2  # tries of one verifying server's forward whose stream closed unanswered

# |a - b| <= tolerance x (|b| + the token's RMS), per element. A stateless forward computes the whole prefix at once
# and rounds differently from the cached path it checks (measured on bloombee-tiny, 72 tokens, 4 blocks: up to 0.026
# in bfloat16, i.e. ~7 ulps of its 2^-8 epsilon, and 1e-5 in float32); the tolerances leave ~4x over that (float16
# scaled by its epsilon, 8x finer than bfloat16's) and stay far below a real fault (noise of the outputs' own scale: ~1)
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}
OPINIONS = 3  # the chain's server, a verifier and, on disagreement, a referee


class Untrusted(ServerFailed):
    """A server of the chain lost a verification (it was banned): re-route it and every span after it."""

    def __init__(self, index: int, reason: str):
        super().__init__(index, reason, ban=False)


def tolerance(*tensors: torch.Tensor) -> float:
    """The relative tolerance of the coarsest dtype among `tensors`."""
    return max(TOLERANCE.get(tensor.dtype, TOLERANCE[torch.float32]) for tensor in tensors)


def difference(claimed: torch.Tensor, recomputed: torch.Tensor, mask: torch.Tensor) -> float:
    """The worst |a - b| / (|b| + the token's RMS) over the real tokens of `mask` ([batch, positions])."""
    a, b = claimed.float(), recomputed.float()
    rms = b.pow(2).mean(-1, keepdim=True).sqrt()
    ratio = ((a - b).abs() / (b.abs() + rms + 1e-12)).amax(-1)
    return float(ratio[mask].max()) if bool(mask.any()) else 0.0


class Verifier:
    """Decides which spans a step checks and runs the checks; one per inference session."""

    def __init__(self, manager: SequenceManager, p2p: P2P, settings: ClientSettings, policy_for):
        self.manager, self.p2p, self.settings, self.policy_for = manager, p2p, settings, policy_for
        self.rng = random.Random(settings.verify_seed)
        self.checks = 0  # verifications run (each with at least one recomputation)
        self.untrusted: list[str] = []  # peer ids banned for disagreeing, in order
        self.largest_agreeing = 0.0  # the largest difference of a chain server's outputs from an agreeing opinion
        self._checked: weakref.WeakSet = weakref.WeakSet()  # the streams checked once already
        self._unverifiable: set[tuple[int, int]] = set()  # spans logged as not verifiable

    @property
    def enabled(self) -> bool:
        return self.settings.verify_probability > 0

    def due(self, stream: SpanStream) -> bool:
        """Whether this step checks `stream`: always until its first check in the chain, else with verify_probability;
        never while no other server holds its blocks."""
        draw = self.rng.random()
        if stream in self._checked and draw >= self.settings.verify_probability:
            return False
        if not self._holders(stream.span):
            self._skip(stream.span, "none holds them")
            return False
        return True

    async def check(self, stream: SpanStream, inputs: torch.Tensor, claimed: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether the chain's server of `stream` is trusted for outputs `claimed` of `inputs` (both over [0, end)),
        banning whoever no other opinion agrees with; a stream no other server could check stays due."""
        span = stream.span
        opinions = {span.peer_id: claimed}
        for peer_id, record in self._candidates(span):
            recomputed = await self._recompute(Span(peer_id, span.start, span.end, record), inputs, mask)
            if recomputed is None:
                continue
            opinions[peer_id] = recomputed
            if len(opinions) == OPINIONS or difference(claimed, recomputed, mask) <= tolerance(claimed, recomputed):
                break
        if len(opinions) == 1:
            self._skip(span, "none answered")
            return True
        self._checked.add(stream)
        self.checks += 1
        return self._judge(span, opinions, mask)

    def _judge(self, span: Span, opinions: dict[str, torch.Tensor], mask: torch.Tensor) -> bool:
        """Ban every server no other opinion agrees with; whether the chain's server is still trusted."""
        trusted = True
        for peer_id, value in opinions.items():
            others = [other for name, other in opinions.items() if name != peer_id]
            closest, allowed = min(difference(value, other, mask) for other in others), tolerance(value, *others)
            if closest <= allowed:
                if peer_id == span.peer_id:
                    self.largest_agreeing = max(self.largest_agreeing, closest)
                continue
            logger.warning("Server %s disagrees on blocks [%d, %d) with %s: max difference %.3g (tolerance %.3g); "
                           "banning it", peer_id, span.start, span.end, [name for name in opinions if name != peer_id],
                           closest, allowed)
            self.manager.ban(peer_id)
            self.untrusted.append(peer_id)
            trusted = trusted and peer_id != span.peer_id
        return trusted

    def _skip(self, span: Span, reason: str) -> None:
        """Say once per span of the session that no other server checks it (for now)."""
        if (span.start, span.end) not in self._unverifiable:
            self._unverifiable.add((span.start, span.end))
            logger.info("No other server could recompute blocks [%d, %d) (%s): not verifying them for now",
                        span.start, span.end, reason)

    def _holders(self, span: Span) -> list[tuple[str, ServerRecord]]:
        """Other usable servers holding all blocks of `span`."""
        return [(peer_id, record) for peer_id, record in self.manager.usable_servers().items()
                if peer_id != span.peer_id and record.start_block <= span.start and span.end <= record.end_block]

    def _candidates(self, span: Span) -> list[tuple[str, ServerRecord]]:
        """The holders of `span`'s blocks in random order."""
        found = self._holders(span)
        self.rng.shuffle(found)
        return found

    async def _recompute(self, span: Span, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """`inputs` through `span` statelessly, or None (logged) where that server cannot answer; a stream that
        closes without an answer is tried once more (hivemind streams occasionally do)."""
        for attempt in range(FORWARD_ATTEMPTS):
            try:
                return await forward_span(self.p2p, span, inputs, None if bool(mask.all()) else mask,
                                          self.policy_for(span.peer_id, span.record), self.settings.request_timeout,
                                          adapter=self.settings.active_adapter)
            except RequestRejected as error:
                logger.info("Server %s cannot verify: %s", span.peer_id, error)
                return None
            except ConnectionError as error:  # not in the chain: no ban; once more, then another server
                logger.warning("Verifying forward through %s failed (%r), attempt %d of %d", span.peer_id, error,
                               attempt + 1, FORWARD_ATTEMPTS)
            except (OSError, asyncio.TimeoutError) as error:
                logger.warning("Verifying forward through %s failed (%r)", span.peer_id, error)
                return None
        return None
