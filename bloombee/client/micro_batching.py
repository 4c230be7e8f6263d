"""`micro_batches="auto"`: the planner's model of the session's chain picks how many micro-batches a step uses.

The chain's servers announce their planner profile (per-block cost table, memory, codec figures)
and link speed in their DHT records. From them the model of the chain (`bloombee.planner.chain`)
builds the planner's inputs for the chain as routed (one node per span, its blocks as the
assignment) and scores every candidate M with the planner's own step model and event simulation,
in which servers computing on the CPU of one machine share its cores; this module takes the fastest. A step of T tokens per row is scored as a decode
step of B x T rows (compute and activation bytes both scale with the tokens of a micro-batch).
Each step's hop reports then tell how fast every server really computed against its table
(`ComputeSpeeds`) and what its codec really did with the session's messages, and the next steps are
scored with those: the client's one view of the chain's figures (`bloombee.client.figures`), which
its compression policies and the speculation switch read too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from bloombee.client.figures import ChainFigures
from bloombee.client.routing import Span
from bloombee.client.steps import StepStats
from bloombee.host import cpu_share, latency_ms
from bloombee.planner import PlanInputs
from bloombee.planner.chain import (
    activation_bytes,
    chain_inputs,
    modelled_compute,
    predicted_step_s,
    timed_by_cpu,
)
from bloombee.planner.costs import micro_batch_size
from bloombee.planner.learning import Recent
from bloombee.planner.model_config import model_section_from_config
from bloombee.protocol import HopReport

logger = logging.getLogger(__name__)

CANDIDATES = (1, 2, 4, 8, 16, 32)
# steps whose measured time against the model's prediction gives the model's error on this client's chains
ERROR_WINDOW = 9
SPEED_TOLERANCE = 1.25  # a chosen M stands while every server's measured speed stays within this factor of its own then
MAX_REMEMBERED = 1024  # decisions kept per model


class MicroBatchChooser:
    """Picks M per step for one model, at the servers' measured compute speeds and codec figures (`figures`, the
    client's view: a view of its own without one); remembers which servers lacked a profile so that it says so once."""

    def __init__(self, config, link_mbps: float, compression: str, figures: ChainFigures | None = None):
        self.model = model_section_from_config(config)
        self.link_mbps, self.compression = link_mbps, compression
        self._unprofiled: set[str] = set()
        self._chosen: dict[tuple, tuple[int, list[float]]] = {}  # step key -> (M, the speeds it was chosen at)
        self._modelled: dict[tuple, tuple[dict[str, float], PlanInputs]] = {}  # step key and M -> modelled compute
        self._predicted: dict[tuple, float] = {}  # (step key, M) -> the model's seconds when M was chosen
        self._raised: dict[tuple, tuple[float, float]] = {}  # (step key, M chosen) -> (message factor, seconds at +1)
        self.prediction_error = Recent(ERROR_WINDOW)  # measured over predicted step time
        self.figures = figures or ChainFigures(link_mbps * 1e6 / 8)

    def __call__(self, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int) -> int:
        """M for one step (more micro-batches only where the model has them faster by more than its measured error,
        `split_margin`: a split that gains less may not pay for its extra messages); steps scored alike (`step_key`)
        reuse it while no server's measured speed, nor the chain's message factor, moved by more than SPEED_TOLERANCE
        since."""
        key = step_key(spans, batch_size, num_tokens, context)
        sizes = {micro_batch_size(batch_size * num_tokens, m) for m in CANDIDATES if m <= batch_size}
        factors = [self.figures.speeds.factor(node_name(span), size) for span in spans for size in sorted(sizes)]
        factors.append(max(self.figures.messages.factor, 1e-9))
        chosen = self._chosen.get(key)
        if chosen is None or any(max(now / then, then / now) > SPEED_TOLERANCE for now, then in zip(factors, chosen[1])):
            if len(self._chosen) >= MAX_REMEMBERED:
                self._chosen.clear()
                self._predicted.clear()
                self._raised.clear()
            chosen = self._chosen[key] = (self._choose(key, spans, batch_size, num_tokens, context), factors)
        return chosen[0]

    @property
    def split_margin(self) -> float:
        """How much faster the model must have more micro-batches: the spread of its measured error (0 until a step
        it predicted was measured)."""
        return self.prediction_error.spread

    def _choose(self, key: tuple, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int) -> int:
        best, best_s, previous_s = 1, float("inf"), float("inf")
        for micro_batches in (m for m in CANDIDATES if m <= batch_size):
            seconds = self.step_seconds(spans, batch_size, num_tokens, context, micro_batches)
            if seconds is None:
                return 1
            self._predicted[(key, micro_batches)] = seconds
            if seconds < best_s * (1 - self.split_margin):
                best, best_s = micro_batches, seconds
            if seconds > previous_s:  # past the minimum: step times fall to one as M grows, then rise
                break
            previous_s = seconds
        used = self.figures.messages.factor  # what the chosen M's steps will teach about messages: see `observe`
        raised = self.step_seconds(spans, batch_size, num_tokens, context, best, used + 1)
        if raised is not None:
            self._raised[(key, best)] = (used, raised)
        return best

    def step_seconds(self, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int,
                     micro_batches: int, message_factor: float | None = None) -> float | None:
        """The planner's simulated time of one step in `micro_batches` micro-batches (at the chain's measured message
        factor unless `message_factor` is given); None without profiles."""
        rows = batch_size * num_tokens
        inputs = self.chain_inputs(spans, rows, -(-context // num_tokens), micro_batch_size(rows, micro_batches),
                                   message_factor)
        if inputs is None:
            return None
        return predicted_step_s(inputs, [span.end - span.start for span in spans], rows, micro_batches)

    def observe(self, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int, step: StepStats) -> None:
        """Learn the servers' compute speeds and the chain's message factor from a step they served (their codecs'
        figures: `ChainFigures`)."""
        micro_batches, reports = step.micro_batches, step.reports
        rows = micro_batch_size(batch_size * num_tokens, micro_batches)
        key = (step_key(spans, batch_size, num_tokens, context), micro_batches)
        if key in self._predicted and step.total_s > 0:
            self.prediction_error.update(step.total_s / self._predicted[key])
            if key in self._raised:
                self.figures.messages.observe(self._raised[key][0], self._predicted[key], self._raised[key][1],
                                              step.total_s)
        if key not in self._modelled:
            inputs = self.chain_inputs(spans, batch_size * num_tokens, -(-context // num_tokens))
            if inputs is None:
                return
            if len(self._modelled) >= MAX_REMEMBERED:
                self._modelled.clear()
            self._modelled[key] = (modelled_compute(inputs, [span.end - span.start for span in spans],
                                                    batch_size * num_tokens, micro_batches), inputs)
        modelled, inputs = self._modelled[key]
        self.figures.speeds.observe(modelled, [node.name for node in inputs.nodes], measured_compute(inputs, reports), rows)

    def chain_inputs(self, spans: Sequence[Span], rows: int, context: int, micro_batch_rows: int | None = None,
                     message_factor: float | None = None) -> PlanInputs | None:
        """The planner's inputs for this chain (with `micro_batch_rows`, each server's cost table scaled by its
        measured speed and each codec's figures as measured at messages of that many rows; every message's CPU by
        the chain's measured factor, or `message_factor`), or None when a server announces no profile."""
        missing = [span.peer_id for span in spans if span.record.profile is None]
        if missing:
            new = set(missing) - self._unprofiled
            if new:
                self._unprofiled |= new
                logger.warning("micro_batches=auto: servers %s announce no planner profile, so steps through them "
                               "are not split", ", ".join(sorted(new)))
            return None
        nodes = [span.record.profile.node(name=node_name(span), offload=span.record.offload) for span in spans]
        client_codec = nodes[0].get("compression")  # the client runs the same codec as the servers
        if micro_batch_rows is not None:
            nodes, client_codec = self.figures.measured_nodes(
                nodes, [span.peer_id for span in spans], micro_batch_rows,
                activation_bytes(self.model["hidden_size"], spans[0].record.dtype))
        links = [self.link_mbps] + [span.record.link_bandwidth * 8 / 1e6 for span in spans]
        return chain_inputs(self.model, nodes, links, [span.end - span.start for span in spans], rows, context,
                            spans[0].record.dtype, self.compression, client_cpu=client_cpu_share(),
                            client_codec=client_codec, message_factor=self.figures.messages.factor
                            if message_factor is None else message_factor)


def measured_compute(inputs: PlanInputs, reports: Sequence[HopReport]) -> list[float]:
    """Each node's compute in one step as its report measures it, in the terms `modelled_compute` models it."""
    return [report.compute_cpu_s if timed_by_cpu(node) else report.compute_s for node, report in zip(inputs.nodes, reports)]


def node_name(span: Span) -> str:
    return f"{span.peer_id}:{span.start}"


def step_key(spans: Sequence[Span], batch_size: int, num_tokens: int, context: int) -> tuple:
    """Steps scored alike: the same chain, batch and tokens per row, over a context in the same power-of-two range."""
    return (tuple((s.peer_id, s.start, s.end, s.record.link_bandwidth) for s in spans), batch_size, num_tokens,
            max(context - 1, 0).bit_length())


def client_cpu_share() -> dict:
    """This client process's CPU share (in a swarm on one machine its messages compete with the servers' compute), what
    messages cost its host, and its end of a hop's latency (`latency_ms`)."""
    return cpu_share(torch.get_num_threads()) | {"latency_ms": latency_ms()}
