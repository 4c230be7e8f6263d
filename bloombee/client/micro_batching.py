"""`micro_batches="auto"`: the planner's model of the session's chain picks how many micro-batches a step uses.

The chain's servers announce their planner profile (per-block cost table, memory, codec figures)
and link speed in their DHT records. From them the model of the chain (`bloombee.planner.chain`)
builds the planner's inputs for the chain as routed (one node per span, its blocks as the
assignment) and scores every candidate M with the planner's own step model and event simulation,
in which servers computing on the CPU of one machine share its cores; this module takes the fastest. A step of T tokens per row is scored as a decode
step of B x T rows (compute and activation bytes both scale with the tokens of a micro-batch).
Each step's hop reports then tell how fast every server really computed against its table
(`ComputeSpeeds`) and what its codec really did with the session's messages (`CodecFigures`), and
the next steps are scored with those.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from bloombee.client.routing import Span
from bloombee.client.steps import StepStats
from bloombee.codec.policy import SizeEstimates
from bloombee.host import cpu_share, latency_ms
from bloombee.planner import PlanInputs
from bloombee.planner.chain import (
    chain_inputs,
    modelled_compute,
    predicted_step_s,
    scaled_cost,
    timed_by_cpu,
)
from bloombee.planner.costs import micro_batch_size
from bloombee.planner.inputs import CLIENT
from bloombee.planner.learning import Recent, nearest_class, size_class
from bloombee.planner.model_config import model_section_from_config
from bloombee.protocol import HopReport

logger = logging.getLogger(__name__)

CANDIDATES = (1, 2, 4, 8, 16, 32)
# steps whose mean is each server's measured compute speed (its reported compute time against the model's)
SPEED_WINDOW = 5
# steps whose measured time against the model's prediction gives the model's error on this client's chains
ERROR_WINDOW = 9
SPEED_TOLERANCE = 1.25  # a chosen M stands while every server's measured speed stays within this factor of its own then
MAX_REMEMBERED = 1024  # decisions kept per model


class MicroBatchChooser:
    """Picks M per step for one model, at the servers' measured compute speeds; remembers which servers lacked a
    profile so that it says so once."""

    def __init__(self, config, link_mbps: float, compression: str):
        self.model = model_section_from_config(config)
        self.link_mbps, self.compression = link_mbps, compression
        self._unprofiled: set[str] = set()
        self._chosen: dict[tuple, tuple[int, list[float]]] = {}  # step key -> (M, the speeds it was chosen at)
        self._modelled: dict[tuple, tuple[dict[str, float], PlanInputs]] = {}  # step key and M -> modelled compute
        self._predicted: dict[tuple, float] = {}  # (step key, M) -> the model's seconds when M was chosen
        self.prediction_error = Recent(ERROR_WINDOW)  # measured over predicted step time
        self.speeds = ComputeSpeeds()
        self.codecs = CodecFigures()

    def __call__(self, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int) -> int:
        """M for one step (more micro-batches only where the model has them faster by more than its measured error,
        `split_margin`: a split that gains less may not pay for its extra messages); steps scored alike (`step_key`)
        reuse it while no server's measured speed moved by more than SPEED_TOLERANCE since."""
        key = step_key(spans, batch_size, num_tokens, context)
        sizes = {micro_batch_size(batch_size * num_tokens, m) for m in CANDIDATES if m <= batch_size}
        factors = [self.speeds.factor(node_name(span), size) for span in spans for size in sorted(sizes)]
        chosen = self._chosen.get(key)
        if chosen is None or any(max(now / then, then / now) > SPEED_TOLERANCE for now, then in zip(factors, chosen[1])):
            if len(self._chosen) >= MAX_REMEMBERED:
                self._chosen.clear()
                self._predicted.clear()
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
        return best

    def step_seconds(self, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int,
                     micro_batches: int) -> float | None:
        """The planner's simulated time of one step in `micro_batches` micro-batches; None without profiles."""
        rows = batch_size * num_tokens
        inputs = self.chain_inputs(spans, rows, -(-context // num_tokens), micro_batch_size(rows, micro_batches))
        if inputs is None:
            return None
        return predicted_step_s(inputs, [span.end - span.start for span in spans], rows, micro_batches)

    def observe(self, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int, step: StepStats) -> None:
        """Learn the servers' compute speeds and the codecs' figures from a step they served."""
        micro_batches, reports = step.micro_batches, step.reports
        rows = micro_batch_size(batch_size * num_tokens, micro_batches)
        self.codecs.observe([node_name(span) for span in spans], rows, step)
        key = (step_key(spans, batch_size, num_tokens, context), micro_batches)
        if key in self._predicted and step.total_s > 0:
            self.prediction_error.update(step.total_s / self._predicted[key])
        if key not in self._modelled:
            inputs = self.chain_inputs(spans, batch_size * num_tokens, -(-context // num_tokens))
            if inputs is None:
                return
            if len(self._modelled) >= MAX_REMEMBERED:
                self._modelled.clear()
            self._modelled[key] = (modelled_compute(inputs, [span.end - span.start for span in spans],
                                                    batch_size * num_tokens, micro_batches), inputs)
        modelled, inputs = self._modelled[key]
        self.speeds.observe(modelled, [node.name for node in inputs.nodes], measured_compute(inputs, reports), rows)

    def chain_inputs(self, spans: Sequence[Span], rows: int, context: int,
                     micro_batch_rows: int | None = None) -> PlanInputs | None:
        """The planner's inputs for this chain (with `micro_batch_rows`, each server's cost table scaled by its
        measured speed and each codec's figures as measured at micro-batches of that many rows), or None when a
        server announces no profile."""
        missing = [span.peer_id for span in spans if span.record.profile is None]
        if missing:
            new = set(missing) - self._unprofiled
            if new:
                self._unprofiled |= new
                logger.warning("micro_batches=auto: servers %s announce no planner profile, so steps through them "
                               "are not split", ", ".join(sorted(new)))
            return None
        nodes = [span.record.profile.node(name=node_name(span), offload=span.record.offload) for span in spans]
        nodes, client_codec = with_measurements(nodes, self.speeds, self.codecs, micro_batch_rows)
        links = [self.link_mbps] + [span.record.link_bandwidth * 8 / 1e6 for span in spans]
        return chain_inputs(self.model, nodes, links, [span.end - span.start for span in spans], rows, context,
                            spans[0].record.dtype, self.compression, client_cpu=client_cpu_share(),
                            client_codec=client_codec)


class ComputeSpeeds:
    """Each server's compute speed against its announced cost table, as its steps measure it, per size class of
    micro-batch (rows): the mean of its recent steps' reported compute over the planner's of that server in the
    same step (`measured_compute` and `modelled_compute`: on a single-threaded CPU server its compute thread's CPU
    time against the table's time, elsewhere wall time against the simulation's). A machine's speed drifts with
    the load of other sessions and tenants, and not alike at every size (few rows read the weights from memory,
    which other processes share; many rows are bound by the core)."""

    def __init__(self):
        self._factors: dict[tuple[str, int], Recent] = {}  # (node, size class) -> measured over modelled

    def factor(self, name: str, rows: int) -> float:
        """Measured over modelled compute time of node `name` at micro-batches of `rows` rows: from the nearest size
        range it has computed (1.0 before any step)."""
        ranges = [size for node, size in self._factors if node == name]
        return self._factors[(name, nearest_class(ranges, rows))].value if ranges else 1.0

    def scaled(self, nodes: list[dict], rows: int) -> list[dict]:
        """The planner node dicts with each cost table, and on a CPU the cost of a message, scaled by its node's
        factor at micro-batches of `rows` rows (a busier or slower machine computes and handles messages slower
        alike)."""
        return [scaled_cost(node, self.factor(node["name"], rows)) for node in nodes]

    def observe(self, modelled: dict[str, float], names: Sequence[str], compute_s: Sequence[float], rows: int) -> None:
        """Fold in one step of micro-batches of `rows` rows: `compute_s[i]`, the compute time node `names[i]`
        reported (`measured_compute`), against `modelled` (`modelled_compute` of the step at the tables' speeds)."""
        for name, measured in zip(names, compute_s):
            if modelled.get(name, 0.0) > 0 and measured > 0:
                self._factors.setdefault((name, size_class(rows)), Recent(SPEED_WINDOW, statistic="mean")).update(
                    measured / modelled[name])


class CodecFigures:
    """Each machine's codec as the session's own messages measure it, per size class of micro-batch (rows): the
    ratio its encodes reach and their speed, and the speed of its decodes. A profile's figures come from one message
    size of other data; until a size class is measured, the nearest measured one stands in, and the profile before
    any."""

    def __init__(self):
        self._sizes: dict[tuple[str, int], SizeEstimates] = {}  # (machine, size range) -> what its codec did

    def observe(self, names: Sequence[str], rows: int, step: StepStats) -> None:
        """Fold in one step of micro-batches of `rows` rows through the servers `names` (the client's encodes, each
        server's encode and decode as its reports time them)."""
        size = size_class(rows)
        if step.client_layout != "raw" and step.sent_wire_bytes:
            messages = step.micro_batches
            self._encoded(CLIENT, size, step.sent_raw_bytes / messages, step.sent_wire_bytes / messages,
                          step.client_encode_s / messages)
        for reports in step.micro_batch_reports:
            incoming = [step.client_layout] + [report.layout for report in reports]
            for name, report, layout in zip(names, reports, incoming):
                if report.layout != "raw":
                    self._encoded(name, size, report.raw_bytes, report.wire_bytes, report.encode_s)
                if layout != "raw" and report.decode_cpu_s > 0:
                    self._estimates(name, size).decode.observe(report.raw_bytes, report.decode_cpu_s)

    def measured(self, name: str, codec: dict | None, rows: int) -> dict | None:
        """A planner compression dict (a profile's `codec`) with what machine `name` measured at `rows` rows."""
        if codec is None:
            return None
        ranges = [size for machine, size in self._sizes if machine == name]
        if not ranges:
            return codec
        estimates = self._sizes[(name, nearest_class(ranges, rows))]
        measured = {"ratio": estimates.ratio.value, "compress_mb_per_s": estimates.encode.speed,
                    "decompress_mb_per_s": estimates.decode.speed}
        return codec | {key: value / 1e6 if key.endswith("_per_s") else value
                        for key, value in measured.items() if value is not None}

    def applied(self, nodes: list[dict], rows: int) -> list[dict]:
        """The planner node dicts with each codec's figures as measured at `rows` rows."""
        return [{**node, "compression": self.measured(node["name"], node.get("compression"), rows)} for node in nodes]

    def _encoded(self, name: str, size: int, raw_bytes: float, wire_bytes: float, seconds: float) -> None:
        estimates = self._estimates(name, size)
        estimates.ratio.update(raw_bytes / wire_bytes)
        estimates.encode.observe(raw_bytes, seconds)

    def _estimates(self, name: str, size: int) -> SizeEstimates:
        key = (name, size)
        if key not in self._sizes:
            self._sizes[key] = SizeEstimates(None, None, None)
        return self._sizes[key]


def with_measurements(nodes: list[dict], speeds: ComputeSpeeds, codecs: CodecFigures,
                      rows: int | None) -> tuple[list[dict], dict | None]:
    """The planner node dicts with, at micro-batches of `rows` rows (None: as announced), each cost table scaled by
    its server's measured speed and each codec's figures as measured; and the client's codec figures (the client
    runs the same codec: the first server's profile stands in until the client has measured its own)."""
    client_codec = nodes[0].get("compression")
    if rows is None:
        return nodes, client_codec
    return codecs.applied(speeds.scaled(nodes, rows), rows), codecs.measured(CLIENT, client_codec, rows)


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
