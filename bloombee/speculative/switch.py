"""When speculation pays: the break-even bandwidth S* of the paper's equation 8, from measured rounds.

A plain round commits one token per row in time F_plain + K_plain / S; a tree round commits a tokens
per row (its acceptance) in F_tree + K_tree / S, plus the draft's time c. F is the round's time apart
from moving bytes over the links, K the bytes it moves, each hop's bytes weighted by how much
slower that hop's link is than the slowest, S the slowest link's bandwidth. Speculation is faster
exactly when S > S* = (K_tree - a K_plain) / (a F_plain - F_tree - c): the paper's equation 8
(`bloombee.planner.rules`), with the hops, compute and latency measured rather than modelled.

With mode ``auto`` the switch measures a few plain rounds, then the configured tree; while S <= S*
it moves to the first smaller tree (narrower widths, a higher pruning threshold) that the measured
figures, scaled to its size, say could pay, and when none could it decodes plainly, trying the
trees again every ``recheck_rounds`` rounds, doubled at each recheck (HOPELESS_WAIT times as long
when the configured tree would lose even accepting its whole depth every round). The configured tree's acceptance is averaged over its
last ACCEPTANCE_WINDOW rounds, across rechecks: a short stretch of text the draft guesses badly
does not stop a tree that pays over the generation. Each decision is logged once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from bloombee.planner.learning import Recent
from bloombee.planner.rules import slowest_link_bytes, speculation_break_even, speculation_pays, transfer_seconds
from bloombee.speculative.draft import tree_size

logger = logging.getLogger(__name__)

PLAIN_PROBES = 2  # plain rounds measured before the first tree
TREE_PROBES = 3  # rows' rounds a tree size is measured before it is judged (then it is judged after every round)
WINDOW = 16  # rounds of each kind the judgement averages
SHRINK_TAU = (None, 0.4, 0.5)  # the pruning threshold at each shrink level (None: the configured one)
ACCEPTANCE_WINDOW = 64  # rounds of the configured tree whose acceptance its judgement averages
HOPELESS_WAIT = 8  # how many times longer plain decoding lasts before a recheck when no acceptance could pay


def shrunk(widths: tuple[int, ...], level: int) -> tuple[int, ...]:
    """The widths at shrink level `level`: 0 as configured, 1 each width halved, 2 a single chain."""
    if level == 0:
        return widths
    if level == 1:
        return tuple(max(1, width // 2) for width in widths)
    return (1,) * len(widths)


def hop_weighted_bytes(step, bandwidths: list[float]) -> float:
    """Bytes a step moved over each hop (client to first server, ..., last server to client), each weighted by the
    slowest link's bandwidth over that hop's: the bytes it would take the slowest link as long to move."""
    return slowest_link_bytes([step.sent_wire_bytes] + [report.wire_bytes for report in step.reports], bandwidths)


def recent(window: int = WINDOW) -> Recent:
    """The mean of the last `window` values, 0 before any (steadier than a fast running average on noisy round
    times)."""
    return Recent(window, 0.0, "mean")


@dataclass
class Measured:
    """One kind of round, over its recent rounds: time apart from transfers, weighted bytes, draft time, acceptance."""

    fixed: Recent = field(default_factory=recent)
    weighted_bytes: Recent = field(default_factory=recent)
    draft_s: Recent = field(default_factory=recent)
    accepted: Recent = field(default_factory=recent)
    rounds: int = 0
    row_rounds: int = 0  # rounds times the rows that took part in them


class SpeculationSwitch:
    """Decides each round whether to speculate and with which tree: mode 'on', 'off' or 'auto' (measured S*)."""

    def __init__(self, mode: str = "auto", bandwidths: list[float] | None = None, recheck_rounds: int = 32):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"speculation mode must be auto, on or off, got {mode!r}")
        self.mode, self.recheck_rounds = mode, recheck_rounds
        self.bandwidths = bandwidths  # of each hop, bytes/s: the client's view of the session's chain (`ChainFigures`)
        self.level, self.plain, self.tree = 0, Measured(), Measured()
        self.off, self.rounds_since_check, self.recheck_in = False, 0, recheck_rounds
        self.configured_accepted = recent(ACCEPTANCE_WINDOW)  # the configured tree's, kept across rechecks
        self.probes = TREE_PROBES  # rounds measured before a tree is judged: fewer at a recheck
        self.configured: tuple[int, ...] = ()
        self.decision: str | None = None
        self.last_break_even: float | None = None

    @property
    def slowest(self) -> float:
        return min(self.bandwidths) if self.bandwidths else math.inf

    def speculate(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        if self.plain.rounds < PLAIN_PROBES:
            return False
        if self.off:
            self.rounds_since_check += 1
            if self.rounds_since_check < self.recheck_in:
                return False
            self.off, self.level, self.tree, self.probes = False, 0, Measured(), 1
            self.recheck_rounds *= 2  # each recheck that loses costs rounds: ever rarer
            self._decide("rechecking speculation after plain decoding")
        return True

    def untried(self) -> bool:
        """Whether the next tree round would be the first at this level since the switch last decided."""
        return self.mode == "auto" and self.tree.rounds == 0

    def consider(self, plain_s: float | None, tree_s: float | None, depth: int) -> bool:
        """Before trying a tree: False (and plain decoding) when the planner's predicted times of a plain and a tree
        step say it could not pay even if every round accepted its whole depth; True otherwise (or unknown)."""
        if plain_s is None or tree_s is None or (depth + 1) * plain_s > tree_s:
            return True
        self.off, self.rounds_since_check = True, 0
        self._decide(f"decoding without speculation: the planner predicts {tree_s * 1e3:.1f} ms for a tree step and "
                     f"{plain_s * 1e3:.1f} ms for a plain one, more than the tree's {depth + 1} tokens at best repay")
        return False

    def widths(self, configured: tuple[int, ...]) -> tuple[int, ...]:
        self.configured = configured
        return shrunk(configured, self.level)

    def prune_tau(self, configured: float | None) -> float | None:
        tau = SHRINK_TAU[self.level]
        return configured if tau is None or configured is None else max(configured, tau)

    def observe_plain(self, seconds: float, step) -> None:
        self._observe(self.plain, seconds, step, 0.0, 1.0)

    def observe_tree(self, seconds: float, draft_s: float, accepted: float, step, rows: int = 1) -> None:
        """A tree round of `rows` live rows: its time apart from the draft's, the draft's, the tokens its slowest row
        committed. A batch's round shows as many rows' acceptance: it is judged after fewer rounds."""
        self._observe(self.tree, seconds, step, draft_s, accepted)
        self.tree.row_rounds += rows
        if self.level == 0:
            self.configured_accepted.update(accepted)
        if self.mode == "auto" and self.tree.row_rounds >= self.probes:
            self._judge()

    def _observe(self, measured: Measured, seconds: float, step, draft_s: float, accepted: float) -> None:
        weighted = hop_weighted_bytes(step, self.bandwidths) if self.bandwidths else 0.0
        measured.fixed.update(seconds - transfer_seconds(weighted, self.slowest))
        measured.weighted_bytes.update(weighted)
        measured.draft_s.update(draft_s)
        measured.accepted.update(accepted)
        measured.rounds += 1

    def _judge(self) -> None:
        """Keep this tree while it is faster than plain decoding (S > S*); else the first smaller tree that could be
        (predicted from this one's figures), or plain decoding."""
        penalty, saving = self._terms(1.0)
        self.last_break_even = speculation_break_even(penalty, saving)
        described = (f"S = {self.slowest * 8 / 1e6:.1f} Mbit/s, S* = {self.last_break_even * 8 / 1e6:.1f} Mbit/s, "
                     f"{self._accepted():.2f} tokens per round")
        if speculation_pays(self.slowest, penalty, saving):
            self._decide(f"speculating with tree level {self.level}: {described}")
            return
        size = tree_size(shrunk(self.configured, self.level))
        for level in range(self.level + 1, len(SHRINK_TAU)):
            penalty, saving = self._terms(tree_size(shrunk(self.configured, level)) / size)
            if speculation_pays(self.slowest, penalty, saving):  # a new size is measured in full, even after a one-round recheck
                self.level, self.tree, self.probes = level, Measured(), TREE_PROBES
                self._decide(f"shrinking the tree to level {level}: {described}")
                return
        self.off, self.rounds_since_check = True, 0
        self.recheck_in = self.recheck_rounds * (HOPELESS_WAIT if self._hopeless(size) else 1)
        self._decide(f"decoding without speculation: {described}")

    def _hopeless(self, size: int) -> bool:
        """Whether the configured tree would lose even if every row accepted its whole depth every round (from the
        measured tree's figures, `size` nodes, scaled to it)."""
        penalty, saving = self._terms(tree_size(self.configured) / size, accepted=len(self.configured) + 1.0)
        return not speculation_pays(self.slowest, penalty, saving)

    def _accepted(self) -> float:
        """Tokens per row per round of the measured tree: the configured one's over its longer window."""
        return self.configured_accepted.value if self.level == 0 else self.tree.accepted.value

    def _terms(self, scale: float, accepted: float | None = None) -> tuple[float, float]:
        """Equation 8's extra weighted bytes and time saved per round for a tree `scale` times the measured one's
        size, with the measured acceptance (a smaller tree accepts at most as much) unless `accepted` is given."""
        plain, tree = self.plain, self.tree
        accepted = self._accepted() if accepted is None else accepted
        tree_bytes = plain.weighted_bytes.value + (tree.weighted_bytes.value - plain.weighted_bytes.value) * scale
        tree_fixed = plain.fixed.value + (tree.fixed.value - plain.fixed.value) * scale
        return tree_bytes - accepted * plain.weighted_bytes.value, accepted * plain.fixed.value - tree_fixed - tree.draft_s.value

    def _decide(self, text: str) -> None:
        """Log a decision once (not again while it stays the same)."""
        kind = text.split(":")[0]
        if kind != self.decision:
            logger.info("Speculation: %s", text)
            self.decision = kind
