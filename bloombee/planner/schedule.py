"""The micro-batch schedule of one decoding step, simulated event by event, and its plot.

Resources: the client's uplink, and per active stage its GPU and its uplink to the next stage (the
last one's goes back to the client). Each micro-batch is sent by the client, computed by stage 1,
sent on, computed by stage 2, ... and sent back; every resource handles one micro-batch at a time,
in order. Compute and transfers of different micro-batches overlap (the paper's Fig. 3).

The planner's objective is the closed form of ``evaluate`` (eq. 4); the simulation is what
``--plot`` draws, and its makespan is reported alongside. The two agree for M = 1. For M >= 2 the
simulated makespan of identical micro-batches through 2N' + 1 serial resources is
sum(all times) + (M - 1) * max(time), which is below eq. 4's (M + N' - 1) * max when compute and
transfer are unbalanced and above it when every stage is close to the bottleneck in both.
"""

from __future__ import annotations

from dataclasses import dataclass

from .evaluate import Evaluation


@dataclass
class Interval:
    row: str  # resource label
    kind: str  # "compute" or "transfer"
    micro_batch: int
    start_s: float
    end_s: float


def simulate(evaluation: Evaluation) -> tuple[list[Interval], float]:
    """(intervals, makespan in seconds) of one step of this (feasible) evaluation."""
    if not evaluation.feasible:
        raise ValueError(f"cannot schedule an infeasible plan: {evaluation.reason}")
    stages = evaluation.active_stages
    client_hop = evaluation.client_hop
    rows_free: dict[str, float] = {}
    intervals: list[Interval] = []

    def run(row: str, kind: str, mb: int, ready: float, duration: float) -> float:
        start = max(ready, rows_free.get(row, 0.0))
        end = start + duration
        rows_free[row] = end
        intervals.append(Interval(row, kind, mb, start, end))
        return end

    makespan = 0.0
    for mb in range(evaluation.micro_batches):
        t = run(f"client -> {client_hop.dst}", "transfer", mb, 0.0, client_hop.time_s)
        for stage in stages:
            t = run(f"{stage.node} compute", "compute", mb, t, stage.t_comp_s)
            t = run(f"{stage.node} -> {stage.hop.dst}", "transfer", mb, t, stage.t_comm_s)
        makespan = max(makespan, t)
    return intervals, makespan


def row_order(evaluation: Evaluation) -> list[str]:
    rows = [f"client -> {evaluation.client_hop.dst}"]
    for stage in evaluation.active_stages:
        rows += [f"{stage.node} compute", f"{stage.node} -> {stage.hop.dst}"]
    return rows


def plot_schedule(evaluation: Evaluation, path: str, title: str = "") -> float:
    """Draw the schedule as a Gantt chart (PNG); returns the simulated makespan in seconds."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.patches import Patch  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - matplotlib is a dev extra
        raise RuntimeError("--plot needs matplotlib (pip install 'bloombee[dev]')") from exc
    intervals, makespan = simulate(evaluation)
    rows = row_order(evaluation)
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
            hatch="//" if item.kind == "transfer" else None,
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
            plt.Line2D([], [], color="black", linestyle="--", label=f"simulated step {makespan * 1e3:.1f} ms"),
            plt.Line2D([], [], color="red", linestyle=":", label=f"planner's estimate {evaluation.step_time_s * 1e3:.1f} ms"),
        ],
        loc="lower center",
        ncol=4,
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
