"""Score one assignment: per-stage times, offload fractions, memory and the step's throughput.

Without micro-batching (M = 1) a decoding step of the whole batch walks the chain once:

    T_step = T_hop(client -> first) + sum over active stages (T_comp(i) + T_comm(i))

where T_comm(i) is the hop from stage i to the next active stage (the last one's goes back to the
client). With M >= 2 micro-batches the transfers overlap the compute: M identical micro-batches go
through the chain's resources (the client's uplink, each stage's compute and uplink) in order, so

    T_step = S + (M - 1) * C,   C = max(T_hop(client -> first), max_i max(T_comp(i), T_comm(i)))

with S the one-micro-batch sum above: the makespan of a flow shop of identical jobs, which the
event simulation (``schedule.simulate``) reproduces before processes share cores. (The paper's
eq. 4, (M + N' - 1) * C, charges every stage the bottleneck's time in the fill and drain: up to 2x
the simulated step where hops are the bottleneck.) Throughput = B / T_step tokens per second (one
token per sequence per step).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from bloombee.weight_formats import QuantType

from .costs import STATUS_OK, StepModel
from .inputs import CLIENT, PlanInputs


@dataclass
class HopResult:
    src: str
    dst: str
    time_s: float
    compressed: bool
    raw_bytes: float
    wire_bytes: float
    bandwidth_mbps: float
    latency_s: float


@dataclass
class StageResult:
    node: str
    index: int
    blocks: int
    start: int
    end: int
    alpha: float
    gpu_used_bytes: float
    host_used_bytes: float
    gpu_capacity_bytes: float
    host_capacity_bytes: float
    t_comp_s: float
    hop: HopResult | None  # outgoing hop (None for a skipped node)
    fits: bool
    problem: str = ""
    quant_type: QuantType | None = None  # the precision of its weights (None for a skipped node)
    weight_bytes: float = 0.0  # its blocks' weights on the device
    borrowed_cost: bool = False  # its precision is timed by the node's cost at another (no quant_costs entry)

    @property
    def active(self) -> bool:
        return self.blocks > 0

    @property
    def t_comm_s(self) -> float:
        return self.hop.time_s if self.hop is not None else 0.0

    @property
    def cycle_s(self) -> float:
        return max(self.t_comp_s, self.t_comm_s)


@dataclass
class Evaluation:
    feasible: bool
    reason: str
    assignment: list[int]
    batch_size: int
    micro_batches: int
    micro_batch_size: int
    stages: list[StageResult] = field(default_factory=list)
    client_hop: HopResult | None = None
    num_active: int = 0
    step_time_s: float = math.inf
    cycle_s: float | None = None
    throughput: float = 0.0
    bottleneck: str | None = None
    objective: str = "sum"

    @property
    def alphas(self) -> list[float]:
        return [s.alpha for s in self.stages]

    @property
    def quant_types(self) -> list[QuantType | None]:
        """Per node, the precision of its weights (None for a skipped node)."""
        return [s.quant_type for s in self.stages]

    @property
    def active_stages(self) -> list[StageResult]:
        return [s for s in self.stages if s.active]

    def to_dict(self) -> dict:
        out = asdict(self)
        for stage, raw in zip(self.stages, out["stages"]):
            raw["active"] = stage.active
            raw["t_comm_s"] = stage.t_comm_s
            raw["cycle_s"] = stage.cycle_s
        return _finite(out)


def _finite(value):
    """JSON has no infinity: write it as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def check_assignment(inputs: PlanInputs, assignment: Sequence[int]) -> list[int]:
    values = [int(v) for v in assignment]
    if len(values) != len(inputs.nodes):
        raise ValueError(f"assignment has {len(values)} entries for {len(inputs.nodes)} nodes")
    if any(v < 0 for v in values) or any(v != a for v, a in zip(values, assignment)):
        raise ValueError(f"assignment must be non-negative integers, got {list(assignment)}")
    if sum(values) != inputs.num_blocks:
        raise ValueError(f"assignment sums to {sum(values)} blocks, the model has {inputs.num_blocks}")
    return values


def evaluate(
    inputs: PlanInputs,
    assignment: Sequence[int],
    batch_size: int,
    micro_batches: int,
    step_model: StepModel | None = None,
) -> Evaluation:
    """Per-stage times, alphas and throughput of ``assignment`` (blocks per node, pipeline order),
    or the reason it is infeasible (``feasible=False``, ``reason``)."""
    blocks = check_assignment(inputs, assignment)
    result = Evaluation(
        feasible=False,
        reason="",
        assignment=blocks,
        batch_size=int(batch_size),
        micro_batches=int(micro_batches),
        micro_batch_size=-(-int(batch_size) // int(micro_batches)),
        objective="sum" if micro_batches == 1 else "pipelined",
    )
    if micro_batches > batch_size:
        result.reason = f"micro_batches ({micro_batches}) exceeds batch_size ({batch_size})"
        return result
    model = step_model or StepModel(inputs, batch_size, micro_batches)
    arrays = model.stage_arrays(np.array(blocks))
    names = model.machine_names
    active = [j for j, l in enumerate(blocks) if l > 0]
    problems = []

    def hop(src: int, dst: int) -> HopResult:
        return HopResult(
            src=names[src],
            dst=names[dst],
            time_s=float(model.hop[src, dst]),
            compressed=bool(model.hop_compressed[src, dst]),
            raw_bytes=float(model.hop_raw_bytes),
            wire_bytes=float(model.hop_wire_bytes[src, dst]),
            bandwidth_mbps=float(model.hop_bandwidth_mbps[src, dst]),
            latency_s=float(model.hop_latency_s[src, dst]),
        )

    start = 0
    successor = {a: b for a, b in zip(active, active[1:] + [model.client])}
    for j, spec in enumerate(inputs.nodes):
        fits = int(arrays.status[j]) == STATUS_OK
        quant = model.precisions[int(arrays.quant[j])] if blocks[j] else None
        problem = "" if fits else model.explain_capacity(j, blocks[j])
        if problem:
            problems.append(f"node '{spec.name}' cannot hold {blocks[j]} blocks: {problem}")
        result.stages.append(
            StageResult(
                node=spec.name,
                index=j,
                blocks=blocks[j],
                start=start,
                end=start + blocks[j],
                alpha=float(arrays.alpha[j]),
                gpu_used_bytes=float(arrays.gpu_used[j]),
                host_used_bytes=float(arrays.host_used[j]),
                gpu_capacity_bytes=float(model.gpu_bytes[j]),
                host_capacity_bytes=float(model.host_bytes[j]),
                t_comp_s=float(arrays.comp[j]),
                hop=hop(j, successor[j]) if j in successor else None,
                fits=fits,
                problem=problem,
                quant_type=quant,
                weight_bytes=float(arrays.weights[j]),
                borrowed_cost=quant is not None and spec.borrows_cost(quant),
            )
        )
        start += blocks[j]
    result.client_hop = hop(model.client, active[0])
    result.num_active = len(active)
    if problems:
        result.reason = "; ".join(problems)
        return result

    # the same order of operations as the dynamic program, so the two agree to the last bit
    stages = [result.stages[j] for j in active]
    total = cycle = result.client_hop.time_s
    label = f"{CLIENT} -> {result.client_hop.dst} (transfer)"
    for stage in stages:
        total = total + stage.t_comp_s
        total = total + stage.t_comm_s
        if stage.t_comp_s > cycle:
            cycle, label = stage.t_comp_s, f"{stage.node} (compute)"
        if stage.t_comm_s > cycle:
            cycle, label = stage.t_comm_s, f"{stage.node} -> {stage.hop.dst} (transfer)"
    result.cycle_s = cycle
    result.step_time_s = total if micro_batches == 1 else total + (micro_batches - 1) * cycle
    result.bottleneck = label
    result.throughput = batch_size / result.step_time_s if result.step_time_s > 0 else math.inf
    result.feasible = True
    return result
