"""`micro_batches="auto"`: the planner's model of the session's chain picks how many micro-batches a step uses.

The chain's servers announce their planner profile (per-block cost table, memory, codec figures)
and link speed in their DHT records. From them this module builds the planner's inputs for the
chain as routed (one node per span, its blocks as the assignment) and scores every candidate M
with the planner's own step model and event simulation (`bloombee.planner.evaluate` and
`schedule.simulate`, in which servers computing on the CPU of one machine share its cores), then
takes the fastest. A step of T tokens per row is scored as a decode
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
from bloombee.host import cpu_share
from bloombee.protocol import HopReport
from bloombee.planner import NodeSpec, PlanInputs, evaluate
from bloombee.planner.learning import Recent, nearest_class, size_class
from bloombee.planner.costs import micro_batch_size
from bloombee.planner.inputs import CLIENT
from bloombee.planner.model_config import model_section_from_config
from bloombee.planner.schedule import cpu_shares, simulate

logger = logging.getLogger(__name__)

CANDIDATES = (1, 2, 4, 8, 16, 32)
# wire latency of one message on one hop beyond its bytes (veth, daemons' sockets)
MESSAGE_OVERHEAD_MS = 0.2
# CPU time one message costs each end of a hop on a CPU host (protobuf, asyncio, the p2p daemon, the codec call),
# taken in turns with that process's compute (one interpreter) and shared with the host's other processes; fitted on
# netbench's bloombee-tiny and pipeline sweeps, where steps of M micro-batches grew by about this much per message
MESSAGE_CPU_MS = 0.8
# the same for the client, whose process does nothing else while it sends a step or takes its output: netbench's
# unsplit steps on an unshaped link took 0.9-1.2 ms (bloombee-tiny) and 2.4-2.8 ms (the pipeline model) less on the
# client's two hops than on the hops between servers, which the servers' pipeline stages hand on between threads
CLIENT_MESSAGE_CPU_MS = 0.4
# cores of a CPU host that its DHT peers and event loops keep busy while its servers compute at once, besides the
# daemons' share of each message (`schedule.DAEMON_CORES_PER_MESSAGE`): fitted on netbench's micro-batching sweeps
# together with that share (0.4 without it had the pipeline model's split prompts 1.08-1.20x their measured time and
# bloombee-tiny's 0.81-0.9x; with both, the records of those sweeps re-predict within 0.82-1.18, and the sweeps run
# with both had 6 of 176 cells outside 20 %, which the model without them re-predicts outside too)
HOST_BUSY_CORES = 0.2
# what the p2p stack (two daemons and protobuf per hop) carried on an unshaped veth here (netbench E1: 4 MB prompt
# activations at 0.69 Gbit/s); a message crosses the stack and then its link (`through_stack`): so modelled, the
# prompt steps of netbench's pipeline sweep came within 20 % of their measured time in 43 of 44 cells (the slower of
# the two alone had left 2 of 44 outside in the sweep before), and all 44 with `schedule`'s acknowledgement term
STACK_MBPS = 700.0
# steps whose mean is each server's measured compute speed (its reported compute time against the model's)
SPEED_WINDOW = 5
# more micro-batches are chosen only where the model has them this much faster: within its error (netbench: whole
# prompts on fast links predicted up to 1.12x their time, split ones down to 0.87x) a split that gains less does not
# pay for its extra messages
SPLIT_MARGIN = 0.05
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
        self.speeds = ComputeSpeeds()
        self.codecs = CodecFigures()

    def __call__(self, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int) -> int:
        """M for one step (more micro-batches only where the model has them SPLIT_MARGIN faster); steps scored alike
        (`step_key`) reuse it while no server's measured speed moved by more than SPEED_TOLERANCE since."""
        key = step_key(spans, batch_size, num_tokens, context)
        sizes = {micro_batch_size(batch_size * num_tokens, m) for m in CANDIDATES if m <= batch_size}
        factors = [self.speeds.factor(node_name(span), size) for span in spans for size in sorted(sizes)]
        chosen = self._chosen.get(key)
        if chosen is None or any(max(now / then, then / now) > SPEED_TOLERANCE for now, then in zip(factors, chosen[1])):
            if len(self._chosen) >= MAX_REMEMBERED:
                self._chosen.clear()
            chosen = self._chosen[key] = (self._choose(spans, batch_size, num_tokens, context), factors)
        return chosen[0]

    def _choose(self, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int) -> int:
        best, best_s, previous_s = 1, float("inf"), float("inf")
        for micro_batches in (m for m in CANDIDATES if m <= batch_size):
            seconds = self.step_seconds(spans, batch_size, num_tokens, context, micro_batches)
            if seconds is None:
                return 1
            if seconds < best_s * (1 - SPLIT_MARGIN):
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
        nodes = [{**span.record.profile, "name": node_name(span), "offload": span.record.offload} for span in spans]
        nodes, client_codec = with_measurements(nodes, self.speeds, self.codecs, micro_batch_rows)
        links = [self.link_mbps] + [span.record.link_bandwidth * 8 / 1e6 for span in spans]
        return chain_inputs(self.model, nodes, links, [span.end - span.start for span in spans], rows, context,
                            spans[0].record.dtype, self.compression, client_cpu=client_cpu_share(),
                            client_codec=client_codec)


class ComputeSpeeds:
    """Each server's compute speed against its announced cost table, as its steps measure it, for micro-batches of
    each size (rows, in power-of-two ranges): a mean of its recent steps' reported compute over the planner's of that
    server in the same step (`measured_compute` and `modelled_compute`: on a single-threaded CPU server its compute
    thread's CPU time against the table's time, elsewhere wall time against the simulation's). A machine's speed
    drifts (load from other sessions or other tenants: on netbench's runs here servers computed up to 1.8x slower
    than the tables they had measured minutes before), and not alike at every size: a product of few rows reads
    the weights from memory, which other processes share, while one of many rows is bound by the core (here the
    pipeline model's 32-row decode steps ran 1.27x slower than its table and its 128-row prompt chunks at 1.0x)."""

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
    """Each machine's codec as the session's own messages measure it, for micro-batches of each size (rows, in
    power-of-two ranges): the ratio its encodes reach and their speed, and the speed of its decodes. A profile's
    figures come from one message size of other data: on netbench's bloombee-tiny runs the client's embeddings
    compressed 1.9-2.0x against the profile's 1.47, and a 256 KiB prompt took half its profiled encode time while a
    16 KiB decode step took twice. Until a size range is measured, the nearest measured one stands in, and the
    profile before any."""

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


def timed_by_cpu(node: NodeSpec) -> bool:
    """Whether a node's compute is judged by its CPU time: a CPU node computing on one thread. Its report's
    `compute_cpu_s` is then all of the compute's work, without the waits for a core that the simulation models;
    elsewhere the wall time `compute_s` is judged against the simulation's (a GPU's kernels are not CPU time)."""
    return node.cpu is not None and node.cpu.threads == 1


def measured_compute(inputs: PlanInputs, reports: Sequence[HopReport]) -> list[float]:
    """Each node's compute in one step as its report measures it, in the terms `modelled_compute` models it."""
    return [report.compute_cpu_s if timed_by_cpu(node) else report.compute_s for node, report in zip(inputs.nodes, reports)]


def modelled_compute(inputs: PlanInputs, assignment: list[int], rows: int, micro_batches: int) -> dict[str, float]:
    """Each node's compute time in one step as the planner has it (all its micro-batches; empty if the step does not
    fit): the table's time where the node is timed by its CPU time, else the time the simulation gives it."""
    evaluation = evaluate(inputs, assignment, rows, micro_batches)
    if not evaluation.feasible:
        return {}
    modelled: dict[str, float] = {}
    for interval in simulate(evaluation, cpu_shares(inputs))[0]:
        if interval.kind == "compute":
            name = interval.row.removesuffix(" compute")
            modelled[name] = modelled.get(name, 0.0) + interval.end_s - interval.start_s
    for node, stage in zip(inputs.nodes, evaluation.stages):
        if timed_by_cpu(node) and stage.active:
            modelled[node.name] = stage.t_comp_s * micro_batches
    return modelled


def scaled_cost(node: dict, factor: float) -> dict:
    """A planner node dict with its cost table's (or polynomial's) compute times, and on a CPU its message cost,
    multiplied by `factor`."""
    if factor == 1.0:
        return node
    cost = node["cost"]
    part = "table" if cost.get("table") is not None else "coefficients"
    scaled = {key: values if key == "micro_batch" else [value * factor for value in values]
              for key, values in cost[part].items()}
    node = {**node, "cost": {**cost, part: scaled}}
    if node.get("cpu"):
        node["cpu"] = {**node["cpu"], "message_ms": MESSAGE_CPU_MS * factor}
    return node


def node_name(span: Span) -> str:
    return f"{span.peer_id}:{span.start}"


def step_key(spans: Sequence[Span], batch_size: int, num_tokens: int, context: int) -> tuple:
    """Steps scored alike: the same chain, batch and tokens per row, over a context in the same power-of-two range."""
    return (tuple((s.peer_id, s.start, s.end, s.record.link_bandwidth) for s in spans), batch_size, num_tokens,
            max(context - 1, 0).bit_length())


def chain_inputs(model: dict, nodes: list[dict], links_mbps: Sequence[float], blocks: Sequence[int], rows: int, context: int,
                 dtype: str, compression: str, hop_mbps: Sequence[float] | None = None,
                 client_cpu: dict | None = None, client_codec: dict | None = None) -> PlanInputs:
    """Planner inputs of a chain of `nodes` (planner node dicts without links) holding `blocks` blocks each.

    `links_mbps`: the client's link, then each node's, as announced; `hop_mbps` (client -> first node, ...,
    last node -> client), when known, overrides them hop by hop. A step of T tokens per row over a
    `context`-token cache is scored as `rows` = B x T rows over context / T (the same KV bytes).
    `client_codec`: the client's codec figures (without, it has none).
    Every process on a CPU (the nodes that announce a CPU share, and the client when `client_cpu` gives
    its own) spends MESSAGE_CPU_MS of that CPU (the client CLIENT_MESSAGE_CPU_MS) on each message it sends or
    receives, and their host has HOST_BUSY_CORES of its cores fewer for their compute.
    """
    names = [node["name"] for node in nodes]
    overrides = [] if hop_mbps is None else [
        {"src": src, "dst": dst, "bandwidth_mbps": through_stack(mbps)}
        for src, dst, mbps in zip(["client", *names], [*names, "client"], hop_mbps)]
    client = {"link": link(links_mbps[0])}
    if client_codec is not None:
        client["compression"] = client_codec
    if client_cpu is not None:
        client["cpu"] = with_host_costs({"message_ms": CLIENT_MESSAGE_CPU_MS, **client_cpu})
    return PlanInputs.model_validate({
        "model": model | {"num_blocks": sum(blocks)},
        "workload": {"batch_sizes": [rows], "micro_batches": [1], "seq_len": max(context, 1),
                     "dtype": planner_dtype(dtype), "compression": compression},
        "client": client,
        "nodes": [{**node, "link": link(mbps)} | ({"cpu": with_host_costs(node["cpu"])} if node.get("cpu") else {})
                  for node, mbps in zip(nodes, links_mbps[1:])],
        "link_overrides": overrides,
    })


def with_host_costs(cpu: dict) -> dict:
    """A CPU share with its host's costs: the CPU of a message and its stack's rate (unless given) and the cores kept
    busy."""
    return {"message_ms": MESSAGE_CPU_MS, "stack_mbps": STACK_MBPS, **cpu, "busy_cores": HOST_BUSY_CORES}


def through_stack(mbps: float) -> float:
    """The rate at which a message crosses a link of `mbps`: the p2p stack's copies and the link's transmission do not
    overlap (a message's time is the sum of both), so a stack of STACK_MBPS slows even a slow link a little."""
    return 1.0 / (1.0 / mbps + 1.0 / STACK_MBPS)


def link(mbps: float) -> dict:
    mbps = through_stack(mbps)
    return {"uplink_mbps": mbps, "downlink_mbps": mbps, "latency_ms": MESSAGE_OVERHEAD_MS / 2}


def client_cpu_share() -> dict:
    """This client process's CPU share: in a swarm on one machine its messages compete with the servers' compute."""
    return cpu_share(torch.get_num_threads())


def planner_dtype(dtype: str) -> str:
    return dtype if dtype in ("float16", "bfloat16", "float32") else "float32"


def predicted_step_s(inputs: PlanInputs, assignment: list[int], rows: int, micro_batches: int) -> float:
    """The simulated time of one step of `rows` rows in `micro_batches` micro-batches (inf if it does not fit)."""
    return predicted_times(inputs, assignment, rows, micro_batches)["simulated_s"]


def predicted_times(inputs: PlanInputs, assignment: list[int], rows: int, micro_batches: int) -> dict[str, float]:
    """The planner's closed form (eq. 4) and its event simulation of one step (inf where it does not fit)."""
    evaluation = evaluate(inputs, assignment, rows, micro_batches)
    if not evaluation.feasible:
        return {"closed_form_s": float("inf"), "simulated_s": float("inf")}
    return {"closed_form_s": evaluation.step_time_s, "simulated_s": simulate(evaluation, cpu_shares(inputs))[1]}
