"""The chain's measured figures, learnt once per client and read by its three controllers.

Each machine's codec (the client's, each server's) per size class of message (raw bytes): the ratio
its encodes reach, their speed and the speed of its decodes; each server's compute speed against its
announced cost table (`ComputeSpeeds`); the CPU a message takes on the serving path (`MessageCosts`);
and the bandwidth of each hop of a chain. The client's compression policies decide with the codec
figures (`ChainFigures.link`), the micro-batch chooser models the chain with them, the compute speeds
and the message costs, and the speculation switch weighs its rounds'
bytes with the hop bandwidths. The client's encodes are learnt as its policies make them; everything
else from the hop reports of the steps its sessions run (`observe_step`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from bloombee.client.routing import Span
from bloombee.client.steps import StepStats
from bloombee.codec.policy import LinkFigures, SizeEstimates, kept
from bloombee.planner.chain import scaled_cost
from bloombee.planner.inputs import CLIENT
from bloombee.planner.learning import Recent, nearest_class, size_class

COMPUTE_WINDOW = 5  # steps whose mean is each server's measured compute speed
MESSAGE_WINDOW = 9  # steps whose median is the chain's measured message factor


class ChainFigures:
    """The figures one client has measured of the machines its sessions run through (see the module)."""

    def __init__(self, link_bandwidth: float):
        self.link_bandwidth = link_bandwidth  # this client's, bytes/s
        self.speeds = ComputeSpeeds()
        self.messages = MessageCosts()
        self._lock = threading.Lock()
        self._codecs: dict[str, dict[int, SizeEstimates]] = {}  # machine -> size class -> what its codec did

    def link(self, peer_id: str) -> LinkFigures:
        """What the client's policy for its link to server `peer_id` decides with: the client's ratio and encode
        speed, and that server's decode speed."""
        with self._lock:
            return LinkFigures(self._codec(CLIENT), self._codec(peer_id), self._lock)

    def hop_bandwidths(self, spans: Sequence[Span]) -> list[float]:
        """Each hop's bandwidth (bytes/s) of the chain through `spans`, from the client back to it."""
        return chain_bandwidths(self.link_bandwidth, [span.record.link_bandwidth for span in spans])

    def observe_step(self, peers: Sequence[str], step: StepStats) -> None:
        """Fold in one step through the servers `peers` (in chain order), micro-batch by micro-batch: each server's
        encode of what it sent on and its decode of what the hop before sent it, and the client's decode of the
        reply (each decode's CPU seconds, as the receiver's report times it)."""
        with self._lock:
            for reports, client_cpu_s in zip(step.micro_batch_reports, step.received_decode_cpu_s):
                if len(reports) != len(peers) or reports[0].batch_offset not in step.sent:
                    continue
                incoming = [step.sent[reports[0].batch_offset]] + [(report.layout, report.raw_bytes)
                                                                   for report in reports]
                for peer, report, (layout, raw_bytes) in zip(peers, reports, incoming):
                    if report.layout != "raw" and report.wire_bytes:
                        kept(self._codec(peer), report.raw_bytes).observe_encode(report.raw_bytes, report.wire_bytes,
                                                                                  report.encode_s)
                    if layout != "raw" and report.decode_cpu_s > 0:
                        kept(self._codec(peer), raw_bytes).decode.observe(raw_bytes, report.decode_cpu_s)
                layout, raw_bytes = incoming[-1]
                if layout != "raw" and client_cpu_s > 0:
                    kept(self._codec(CLIENT), raw_bytes).decode.observe(raw_bytes, client_cpu_s)

    def decode_speed(self, machine: str, num_bytes: int) -> float | None:
        """How fast `machine` decodes messages of `num_bytes` raw bytes (None before a measured one of that class)."""
        with self._lock:
            estimates = self._codecs.get(machine, {}).get(size_class(num_bytes))
            return None if estimates is None else estimates.decode.speed

    def codec(self, machine: str, announced: dict | None, num_bytes: float) -> dict | None:
        """A planner compression dict (a profile's `codec`, `announced`) with what `machine` measured at messages of
        `num_bytes` raw bytes: the nearest size class measured stands in for one not yet measured."""
        with self._lock:
            classes = self._codecs.get(machine)
            if announced is None or not classes:
                return announced
            estimates = classes[nearest_class(list(classes), num_bytes)]
            measured = {"ratio": estimates.ratio.value, "compress_mb_per_s": estimates.encode.speed,
                        "decompress_mb_per_s": estimates.decode.speed}
        return announced | {key: value / 1e6 if key.endswith("_per_s") else value
                            for key, value in measured.items() if value is not None}

    def measured_nodes(self, nodes: list[dict], peers: Sequence[str], rows: int,
                       row_bytes: int) -> tuple[list[dict], dict | None]:
        """The planner node dicts of servers `peers`, each cost table scaled by its measured speed at micro-batches
        of `rows` rows and each codec's figures as measured at their messages (`rows` hidden vectors of `row_bytes`);
        and the client's codec figures (it runs the same codec: the first server's profile stands in until it has
        measured its own)."""
        scaled, num_bytes = self.speeds.scaled(nodes, rows), rows * row_bytes
        return ([{**node, "compression": self.codec(peer, node.get("compression"), num_bytes)}
                 for node, peer in zip(scaled, peers)], self.codec(CLIENT, nodes[0].get("compression"), num_bytes))

    def _codec(self, machine: str) -> dict[int, SizeEstimates]:
        return self._codecs.setdefault(machine, {})


class MessageCosts:
    """How much CPU a message takes on the serving path against what the hosts measured (`bloombee.host_costs`
    passes bare steps between two daemons; a session's messages also cross the queues, threads and event loops of
    busy processes, which only its steps measure): the factor on every process's `message_ms` that makes the model's
    step time the measured one, the median over recent steps (1 before any)."""

    def __init__(self):
        self._factor = Recent(MESSAGE_WINDOW, 1.0)

    @property
    def factor(self) -> float:
        return self._factor.value

    def observe(self, used: float, predicted_s: float, raised_s: float, measured_s: float) -> None:
        """One step: the model's time with message factor `used` and with `used + 1`, and the measured time (the
        model's time grows about linearly with the factor)."""
        per_factor = raised_s - predicted_s
        if per_factor > 0 and measured_s > 0:
            self._factor.update(max(used + (measured_s - predicted_s) / per_factor, 0.0))


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
        """The planner node dicts with each cost table scaled by its node's factor at micro-batches of `rows`
        rows."""
        return [scaled_cost(node, self.factor(node["name"], rows)) for node in nodes]

    def observe(self, modelled: dict[str, float], names: Sequence[str], compute_s: Sequence[float], rows: int) -> None:
        """Fold in one step of micro-batches of `rows` rows: `compute_s[i]`, the compute time node `names[i]`
        reported (`measured_compute`), against `modelled` (`modelled_compute` of the step at the tables' speeds)."""
        for name, measured in zip(names, compute_s):
            if modelled.get(name, 0.0) > 0 and measured > 0:
                self._factors.setdefault((name, size_class(rows)), Recent(COMPUTE_WINDOW, statistic="mean")).update(
                    measured / modelled[name])


def chain_bandwidths(client: float, servers: list[float]) -> list[float]:
    """Each hop's bandwidth (bytes/s): client to the first server, server to server, last server to the client."""
    ends = [client] + servers + [client]
    return [min(sender, receiver) for sender, receiver in zip(ends[:-1], ends[1:])]
