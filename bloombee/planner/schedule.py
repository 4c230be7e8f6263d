"""The micro-batch schedule of one decoding step, simulated event by event, and its plot.

Resources: the client's uplink, and per active stage its GPU and its uplink to the next stage (the
last one's goes back to the client). Each micro-batch is sent by the client, computed by stage 1,
sent on, computed by stage 2, ... and sent back; every resource handles one micro-batch at a time,
in order. Compute and transfers of different micro-batches overlap (the paper's Fig. 3).

The planner's objective is the closed form of ``evaluate``: the makespan of identical micro-batches
through 2N' + 1 serial resources, sum(one micro-batch's times) + (M - 1) * max(time), which this
simulation reproduces but for what follows. Nodes that compute on the CPU of one machine share its
cores while their micro-batches overlap (processor sharing), which the simulation models when given
the nodes' CPU shares and the closed form does not. There,
each message also costs CPU at both ends of its hop (``CpuShare.message_ms``: kinds "send" and
"receive"): the process's part taken in turns with its compute (one interpreter) and shared with the
host's other processes, its p2p daemon's part on the host's cores beside it; and so does the
process's share of the work its p2p stack does (``CpuShare.stack_mbps``) while the message streams
through it. Every figure of a ``CpuShare`` is what its host measured (``bloombee.host_costs``). A transfer into a node slows
while that node's own uplink sends: the transfer's acknowledgements queue behind the outgoing
message (``ack_slowdown``). netbench shows the simulation is the one that matches measurement, so
the client's `micro_batches="auto"` decides with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .evaluate import Evaluation, HopResult
from .inputs import CLIENT, CpuShare, PlanInputs

# TCP's window: the bytes a hop keeps in flight while its link is the bottleneck (a protocol figure, Linux's autotuned
# window on a home link); their acknowledgements cross the receiver's uplink, so a message that node sends delays
# them (`ack_slowdown`)
ACK_WINDOW_BYTES = 0.6e6


@dataclass
class Interval:
    row: str  # resource label
    kind: str  # "compute" or "transfer"
    micro_batch: int
    start_s: float
    end_s: float


def simulate(evaluation: Evaluation, cpus: Mapping[str, CpuShare] | None = None) -> tuple[list[Interval], float]:
    """(intervals, makespan in seconds) of one step of this (feasible) evaluation.

    ``cpus`` (node name -> CpuShare) marks nodes that compute on a CPU: the compute of nodes on the
    same host shares its cores (processor sharing), so overlapping micro-batches there run slower;
    without it every compute runs at its own speed.
    """
    if not evaluation.feasible:
        raise ValueError(f"cannot schedule an infeasible plan: {evaluation.reason}")
    cpus = cpus or {}
    tasks = _tasks(evaluation, cpus)
    hops = {_transfer_row(hop): hop for hop in chain_hops(evaluation)}
    done = [[None] * len(path) for path in tasks]  # end time of task k of micro-batch mb
    started = [[False] * len(path) for path in tasks]
    next_on: dict[str, int] = {}  # resource -> micro-batch whose turn it is
    active: dict[tuple[int, int], list] = {}  # (mb, k) -> [remaining nominal seconds, start time]
    intervals: list[Interval] = []
    now = 0.0
    while True:
        _start_ready(tasks, done, started, next_on, active, now)
        if not active:
            break
        rates = _rates(tasks, active, cpus, hops)
        step = min(remaining / rates[key] for key, (remaining, _) in active.items())
        now += step
        for key in list(active):
            active[key][0] -= step * rates[key]
            if active[key][0] <= 1e-12:
                mb, k = key
                row, kind, _ = tasks[mb][k]
                intervals.append(Interval(row, kind, mb, active.pop(key)[1], now))
                done[mb][k] = now
                next_on[row] = mb + 1
    return intervals, now


def cpu_shares(inputs: PlanInputs) -> dict[str, CpuShare]:
    """Node name -> CPU share of the nodes that compute on a CPU, and the client's when it declares one (what
    `simulate` shares cores by)."""
    shares = {node.name: node.cpu for node in inputs.nodes if node.cpu is not None}
    if inputs.client.cpu is not None:
        shares[CLIENT] = inputs.client.cpu
    return shares


def _tasks(evaluation: Evaluation, cpus: Mapping[str, CpuShare]) -> list[list[tuple[str, str, float]]]:
    """Per micro-batch, its (resource, kind, seconds) in order: client send, then compute and send per stage.
    Each end of a hop that has a CPU share charging messages handles the message on that CPU (kinds "send" and
    "receive")."""
    path = []
    for index, hop in enumerate(chain_hops(evaluation)):
        if index:
            path.append((f"{hop.src} compute", "compute", evaluation.active_stages[index - 1].t_comp_s))
        path += [*_message(hop.src, "send", cpus), (_transfer_row(hop), "transfer", hop.time_s),
                 *_message(hop.dst, "receive", cpus)]
    return [list(path) for _ in range(evaluation.micro_batches)]


def chain_hops(evaluation: Evaluation) -> list[HopResult]:
    """The step's hops in order: client -> first active stage, then each active stage's outgoing hop."""
    return [evaluation.client_hop] + [stage.hop for stage in evaluation.active_stages]


def _transfer_row(hop: HopResult) -> str:
    return f"{hop.src} -> {hop.dst}"


def _message(node: str, kind: str, cpus: Mapping[str, CpuShare]) -> list[tuple[str, str, float]]:
    """The task of handling a message at `node`: the process's own part of its CPU (its daemon's runs beside it)."""
    share = cpus.get(node)
    seconds = 0.0 if share is None else share.message_ms * (1 - share.daemon_share) * 1e-3
    return [(f"{node} {kind}", kind, seconds)] if seconds > 0 else []


def _start_ready(tasks, done, started, next_on, active, now: float) -> None:
    """Start every task whose micro-batch reached it and whose resource is free and at its turn."""
    for mb, path in enumerate(tasks):
        for k, (row, _, seconds) in enumerate(path):
            if started[mb][k] or (k and done[mb][k - 1] is None) or next_on.get(row, 0) != mb:
                continue
            started[mb][k] = True
            active[(mb, k)] = [seconds, now]


def _rates(tasks, active, cpus: Mapping[str, CpuShare], hops: Mapping[str, HopResult]) -> dict[tuple[int, int], float]:
    """Progress per second of each running task. CPU work (compute, message handling, the stack's share of a
    message streaming through: `streaming`) of one process shares its threads (one interpreter: they take turns),
    and the processes of one host share the cores its other processes leave free (`CpuShare.busy_cores`, at least
    one) with the p2p daemon of each process handling a message (`CpuShare.daemon_share`); a transfer runs at full
    speed unless its receiver's uplink is sending (`ack_slowdown`)."""
    transfers = [hops[tasks[mb][k][0]] for mb, k in active if tasks[mb][k][1] == "transfer"]
    sending = {hop.src: hop for hop in transfers}
    users = {key: _cpu_user(tasks[key[0]][key[1]], cpus) for key in active}
    per_process = streaming(transfers, cpus)
    for node in users.values():
        if node is not None:
            per_process[node] = per_process.get(node, 0.0) + 1
    per_host: dict[str, float] = {}
    for node in {node for node in users.values() if node is not None}:
        per_host[cpus[node].host] = per_host.get(cpus[node].host, 0) + cpus[node].threads
    for (mb, k), node in users.items():
        if node is not None and tasks[mb][k][1] in ("send", "receive"):
            per_host[cpus[node].host] += daemon_cores(cpus[node])
    rates = {}
    for key, node in users.items():
        if node is None:
            row, kind, _ = tasks[key[0]][key[1]]
            reverse = sending.get(hops[row].dst) if kind == "transfer" else None
            rates[key] = 1.0 if reverse is None else ack_slowdown(hops[row], reverse)
            continue
        share = cpus[node]
        rates[key] = min(1.0, max(1.0, share.cores - share.busy_cores) / per_host[share.host]) / per_process[node]
    return rates


def daemon_cores(share: CpuShare) -> float:
    """Cores a process's p2p daemon takes while the process handles a message: its part of the message's CPU over the
    process's own (the same CPU in all, on more cores)."""
    return share.daemon_share / max(1 - share.daemon_share, 1e-9)


def streaming(transfers: list[HopResult], cpus: Mapping[str, CpuShare]) -> dict[str, float]:
    """Node -> the share of its interpreter that the messages streaming through it take: of each running transfer
    it sends or receives, the stack's share of the transfer's time (its rate over the node's `stack_mbps`) times the
    process's share of that work (`interpreter_share`)."""
    load: dict[str, float] = {}
    for hop in transfers:
        for node in (hop.src, hop.dst):
            share = cpus.get(node)
            if share is not None and share.stack_mbps > 0:
                load[node] = load.get(node, 0.0) + share.interpreter_share * min(
                    1.0, hop.bandwidth_mbps / share.stack_mbps)
    return load


def ack_slowdown(hop: HopResult, reverse: HopResult) -> float:
    """The rate (fraction of its own) of a transfer on `hop` while its receiver sends a message on `reverse`: the
    transfer's acknowledgements wait behind that message, on average half its time, and a window of ACK_WINDOW_BYTES
    then lasts that much longer than its round trip alone (the hop's latency both ways and the window at its rate)."""
    round_trip_s = 2 * hop.latency_s + ACK_WINDOW_BYTES * 8 / (hop.bandwidth_mbps * 1e6)
    return round_trip_s / (round_trip_s + reverse.time_s / 2)


def _cpu_user(task: tuple[str, str, float], cpus: Mapping[str, CpuShare]) -> str | None:
    """The node whose CPU a task runs on, or None."""
    row, kind, _ = task
    node = row.removesuffix(f" {kind}")
    return node if kind in ("compute", "send", "receive") and node in cpus else None


def plot_schedule(evaluation: Evaluation, path: str, title: str = "", cpus: Mapping[str, CpuShare] | None = None) -> float:
    """Draw the schedule as a Gantt chart (PNG); returns the simulated makespan in seconds."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.patches import Patch  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - matplotlib is a dev extra
        raise RuntimeError("--plot needs matplotlib (pip install 'bloombee[dev]')") from exc
    intervals, makespan = simulate(evaluation, cpus)
    rows = [row for row, _, _ in _tasks(evaluation, cpus or {})[0]]
    index = {row: i for i, row in enumerate(rows)}
    cmap = plt.get_cmap("tab10" if evaluation.micro_batches <= 10 else "viridis")
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(rows) + 2.2))
    for item in intervals:
        color = cmap(item.micro_batch % 10 if evaluation.micro_batches <= 10 else item.micro_batch / evaluation.micro_batches)
        ax.barh(
            index[item.row],
            (item.end_s - item.start_s) * 1e3,
            left=item.start_s * 1e3,
            height=0.7,
            color=color,
            edgecolor="black",
            linewidth=0.4,
            hatch={"transfer": "//", "send": "..", "receive": ".."}.get(item.kind),
        )
        width_ms = (item.end_s - item.start_s) * 1e3
        if width_ms > makespan * 1e3 * 0.03:
            ax.text(item.start_s * 1e3 + width_ms / 2, index[item.row], f"μ{item.micro_batch + 1}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time within one decoding step (ms)")
    ax.axvline(makespan * 1e3, color="black", linestyle="--", linewidth=0.8)
    ax.axvline(evaluation.step_time_s * 1e3, color="red", linestyle=":", linewidth=0.8)
    fig.legend(
        handles=[
            Patch(facecolor="white", edgecolor="black", label="compute"),
            Patch(facecolor="white", edgecolor="black", hatch="//", label="transfer"),
            Patch(facecolor="white", edgecolor="black", hatch="..", label="message handling (CPU)"),
            plt.Line2D([], [], color="black", linestyle="--", label=f"simulated step {makespan * 1e3:.1f} ms"),
            plt.Line2D([], [], color="red", linestyle=":", label=f"closed-form estimate the DP optimised {evaluation.step_time_s * 1e3:.1f} ms"),
        ],
        loc="lower center",
        ncol=5,
        fontsize=8,
        frameon=False,
    )
    ax.set_title(
        title
        or f"B={evaluation.batch_size}, M={evaluation.micro_batches} (micro-batch {evaluation.micro_batch_size}), "
        f"{evaluation.throughput:.1f} tokens/s; bottleneck {evaluation.bottleneck}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return makespan
