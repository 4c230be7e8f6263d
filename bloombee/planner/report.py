"""Human-readable and JSON reports of a plan (used by ``bloombee-plan``)."""

from __future__ import annotations

from collections.abc import Mapping

from .baselines import BaselineResult
from .evaluate import Evaluation, HopResult, StageResult
from .inputs import GIB, CpuShare, PlanInputs
from .schedule import simulate
from .search import Plan, PrecisionOption, compare_precisions


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _codec(hop: HopResult) -> str:
    if hop.compressed:
        return f"compressed {hop.raw_bytes / hop.wire_bytes:.2f}x"
    return "raw"


def _hop_text(hop: HopResult) -> str:
    return f"{size_text(hop.raw_bytes)} @ {hop.bandwidth_mbps:g} Mbps + {hop.latency_s * 1e3:g} ms"


def model_summary(inputs: PlanInputs) -> dict:
    model, dtype = inputs.model, inputs.workload.dtype
    return {
        "name": model.name,
        "num_blocks": model.num_blocks,
        "hidden_size": model.hidden_size,
        "dtype": dtype,
        "weight_bytes_per_block": model.weight_bytes(dtype),
        "weight_bytes_per_block_by_quant": {quant: model.weight_bytes(dtype, quant)
                                            for quant in inputs.quant_types_in_play},
        "kv_bytes_per_token_per_block": model.kv_bytes_per_token(dtype),
        "activation_bytes_per_token": model.activation_bytes(dtype),
        "workspace_bytes_per_token": model.workspace_bytes(dtype),
    }


def size_text(size: float) -> str:
    """Bytes in the largest unit that keeps the figure at least 1 (so a small model's sizes do not read as 0)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.{_decimals(size / scale)}f} {unit}"
    return f"{size:.0f} B"


def _decimals(value: float) -> int:
    return 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0


def _memory(used: float, capacity: float) -> str:
    return f"{size_text(used)} / {size_text(capacity)}"


def model_line(inputs: PlanInputs) -> str:
    """The report's first line: the model's sizes per block in the workload's dtype, the context and the nodes."""
    model, wl = model_summary(inputs), inputs.workload
    quantised = [f"{quant} {size_text(size)}" for quant, size in model["weight_bytes_per_block_by_quant"].items()
                 if quant != "none"]
    return (f"model {model['name']}: {model['num_blocks']} blocks, {size_text(model['weight_bytes_per_block'])} of "
            f"weights and {size_text(model['kv_bytes_per_token_per_block'])} of KV per token per block ({wl.dtype}); "
            + (f"{', '.join(quantised)} of weights per block; " if quantised else "")
            + f"context {wl.seq_len}; {len(inputs.nodes)} nodes in pipeline order")


def stage_table(evaluation: Evaluation, devices: dict[str, str] | None = None) -> list[str]:
    """One line per node (skipped ones too) and one for the client's uplink; '*' marks the bottleneck. Columns are as
    wide as their widest entry, so nothing is cut."""
    devices = devices or {}
    rows = [_stage_cells(stage, devices.get(stage.node, "")) for stage in evaluation.stages]
    client = ["client", "", "", "", "", "", "", "", _ms(evaluation.client_hop.time_s), _next_hop(evaluation.client_hop)]
    header = ["node", "device", "blocks", "weights", "alpha", "device mem", "host KV", "T_comp ms", "T_comm ms",
              "next hop"]
    widths = [max(len(row[i]) for row in [header, client, *rows]) for i in range(len(header) - 1)]
    marks = [_is_bottleneck(evaluation, stage) for stage in evaluation.stages]
    bottleneck = evaluation.bottleneck or ""
    first = _row(header, widths, " ")
    lines = [first, "  " + "-" * (len(first) - 2), _row(client, widths, "*" if bottleneck.startswith("client ->") else " ")]
    lines += [_row(row, widths, "*" if mark else " ") for row, mark in zip(rows, marks)]
    return [line.rstrip() for line in lines]


def _row(cells: list[str], widths: list[int], mark: str) -> str:
    """Names left-aligned (node, device), figures right-aligned, the next hop last."""
    aligned = [cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))]
    return f"{mark} " + " ".join(aligned) + "  " + cells[-1]


def _stage_cells(stage: StageResult, device: str) -> list[str]:
    if not stage.active:
        return [stage.node, device, "skipped", "", "", "", "", "", "", ""]
    return [stage.node, device, f"{stage.start}:{stage.end} ({stage.blocks})", _weights(stage), f"{stage.alpha:.2f}",
            _memory(stage.gpu_used_bytes, stage.gpu_capacity_bytes), _memory(stage.host_used_bytes, stage.host_capacity_bytes),
            _ms(stage.t_comp_s), _ms(stage.t_comm_s), _next_hop(stage.hop)]


def _weights(stage: StageResult) -> str:
    """A stage's weights: their precision and size on the device."""
    return f"{stage.quant_type} {size_text(stage.weight_bytes)}"


def borrowed_cost_lines(evaluation: Evaluation) -> list[str]:
    """A note per precision timed by nodes' costs at another (no quant_costs entry for it)."""
    borrowed: dict[str, list[str]] = {}
    for stage in evaluation.active_stages:
        if stage.borrowed_cost:
            borrowed.setdefault(stage.quant_type, []).append(stage.node)
    return [f"  ({quant} on {', '.join(nodes)}: no quant_costs.{quant} measured, timed by the node's own cost)"
            for quant, nodes in borrowed.items()]


def _next_hop(hop: HopResult) -> str:
    return f"-> {hop.dst}: {_codec(hop)}, {_hop_text(hop)}"


def _is_bottleneck(evaluation: Evaluation, stage: StageResult) -> bool:
    bottleneck = evaluation.bottleneck or ""
    return stage.active and (bottleneck == stage.node or bottleneck.startswith((f"{stage.node} (", f"{stage.node} ->")))


def simulated_throughput(evaluation: Evaluation, simulated_s: float) -> float:
    """Tokens per second of one simulated step: one token per sequence of the batch."""
    return evaluation.batch_size / simulated_s if simulated_s > 0 else float("inf")


def plot_title(evaluation: Evaluation, simulated_s: float) -> str:
    """The schedule plot's title: the headline figure of the text report."""
    return (f"B={evaluation.batch_size}, M={evaluation.micro_batches} (micro-batch {evaluation.micro_batch_size}), "
            f"{simulated_throughput(evaluation, simulated_s):.1f} tokens/s over the simulated {simulated_s * 1e3:.1f} ms "
            f"step; bottleneck {evaluation.bottleneck}")


def _closed_form(ev: Evaluation) -> str:
    kind = "sum of stage and hop times" if ev.micro_batches == 1 else f"one micro-batch's trip + (M - 1) x cycle {ev.cycle_s * 1e3:.2f} ms"
    return f"closed-form estimate the DP optimised: {ev.step_time_s * 1e3:.1f} ms/step ({kind})"


def text_report(inputs: PlanInputs, plan: Plan, baselines: dict[str, BaselineResult],
                cpus: Mapping[str, CpuShare] | None = None) -> str:
    """The plan as text: the model, the stage table, the headline throughput (from the simulated step), the
    baselines (simulated alike) and the closed-form figures the DP compared."""
    ev = plan.evaluation
    simulated_s = simulate(ev, cpus)[1]
    throughput = simulated_throughput(ev, simulated_s)
    lines = [model_line(inputs), ""]
    lines += stage_table(ev, {node.name: node.gpu or "" for node in inputs.nodes})
    lines += ["  (* bottleneck)", *borrowed_cost_lines(ev)]
    lines += [
        "",
        (f"chosen: batch size B={plan.batch_size}, M={plan.micro_batches} micro-batch(es) of {plan.micro_batch_size}, "
         f"{ev.num_active} active stage(s), assignment {plan.assignment}"),
        (f"throughput: {throughput:.1f} tokens/s (B={plan.batch_size} tokens per simulated step of "
         f"{simulated_s * 1e3:.1f} ms); bottleneck: {ev.bottleneck}"),
        _closed_form(ev),
    ]
    compressed = [f"{h.src}->{h.dst}" for h in _hops(ev) if h.compressed]
    lines.append("compression on: " + (", ".join(compressed) if compressed else "no hop (it does not pay on these links)"))
    lines += ["", "baselines (each at its best candidate B, M by the closed form; tokens/s over its simulated step):"]
    lines += _baseline_lines(baselines, throughput, cpus)
    if len(inputs.workload.quant) > 1:
        lines += ["", "precision comparison (each allowed precision alone, then all; tokens/s, simulated step):"]
        lines += [_precision_line(row) for row in precision_rows(inputs, plan, cpus)]
    lines += ["", "closed-form tokens/s per candidate, what the DP compared (rows B, columns M; - infeasible):"]
    lines += _candidate_grid(plan)
    return "\n".join(lines)


def precision_rows(inputs: PlanInputs, plan: Plan, cpus: Mapping[str, CpuShare] | None = None) -> list[dict]:
    """Per allowed precision alone and for all of them: nodes used, hops, weights per node and tokens/s (over the
    simulated step), or why nothing fits."""
    return [_precision_row(option, cpus) for option in compare_precisions(inputs, plan)]


def _precision_row(option: PrecisionOption, cpus: Mapping[str, CpuShare] | None) -> dict:
    if option.plan is None:
        return {"quant": option.quant, "feasible": False, "reason": option.reason}
    ev = option.plan.evaluation
    return {
        "quant": option.quant,
        "feasible": True,
        "nodes_used": ev.num_active,
        "hops": ev.num_active + 1,
        "weights_gib": {s.node: s.weight_bytes / GIB for s in ev.active_stages},
        "quant_types": {s.node: s.quant_type for s in ev.active_stages},
        "throughput_tokens_per_s": simulated_throughput(ev, simulate(ev, cpus)[1]),
        "batch_size": ev.batch_size,
        "micro_batches": ev.micro_batches,
    }


def _precision_line(row: dict) -> str:
    label = f"  {','.join(row['quant']):<14}"
    if not row["feasible"]:
        return f"{label} infeasible: {row['reason']}"
    weights = ", ".join(f"{node} {gib:.2f} GiB {row['quant_types'][node]}" for node, gib in row["weights_gib"].items())
    return (f"{label} {row['throughput_tokens_per_s']:8.1f} tokens/s  {row['nodes_used']} node(s), {row['hops']} hops, "
            f"B={row['batch_size']} M={row['micro_batches']}; weights per node: {weights}")


def _baseline_lines(baselines: dict[str, BaselineResult], throughput: float,
                    cpus: Mapping[str, CpuShare] | None) -> list[str]:
    lines = []
    for name, label in (("even", "even split"), ("greedy", "greedy (Petals)")):
        result = baselines.get(name)
        if result is None:
            continue
        if result.evaluation is None:
            lines.append(f"  {label:<16} infeasible: {result.reason}")
            continue
        b = result.evaluation
        theirs = simulated_throughput(b, simulate(b, cpus)[1])
        ratio = throughput / theirs if theirs > 0 else float("inf")
        lines.append(f"  {label:<16} {theirs:8.1f} tokens/s  B={b.batch_size} M={b.micro_batches}  {b.assignment}  "
                     f"(plan is {ratio:.2f}x)")
    return lines


def _candidate_grid(plan: Plan) -> list[str]:
    micro = sorted({c.micro_batches for c in plan.candidates})
    lines = ["  " + f"{'B':>6}" + "".join(f"{'M=' + str(m):>10}" for m in micro)]
    for batch in sorted({c.batch_size for c in plan.candidates}):
        row = {c.micro_batches: c for c in plan.candidates if c.batch_size == batch}
        cells = []
        for m in micro:
            cand = row.get(m)
            cells.append(f"{cand.throughput:>10.1f}" if cand is not None and cand.throughput is not None else f"{'-':>10}")
        lines.append("  " + f"{batch:>6}" + "".join(cells))
    return lines


def _hops(ev: Evaluation) -> list[HopResult]:
    return [ev.client_hop] + [s.hop for s in ev.active_stages]


def json_report(inputs: PlanInputs, plan: Plan, baselines: dict[str, BaselineResult],
                cpus: Mapping[str, CpuShare] | None = None) -> dict:
    """The plan as JSON: ``throughput_tokens_per_s`` is the headline figure (over the simulated step); the plan's
    own ``throughput_tokens_per_s`` and ``step_time_s`` are the closed form the DP optimised."""
    simulated_s = simulate(plan.evaluation, cpus)[1]
    return {
        "model": model_summary(inputs),
        "workload": inputs.workload.model_dump(),
        "nodes": inputs.node_names,
        "throughput_tokens_per_s": simulated_throughput(plan.evaluation, simulated_s),
        "simulated_step_s": simulated_s,
        "closed_form_step_s": plan.evaluation.step_time_s,
        "plan": plan.to_dict(),
        "compressed_hops": [f"{h.src}->{h.dst}" for h in _hops(plan.evaluation) if h.compressed],
        "baselines": {name: result.to_dict() for name, result in baselines.items()},
        **({"precision_comparison": precision_rows(inputs, plan, cpus)} if len(inputs.workload.quant) > 1 else {}),
    }
