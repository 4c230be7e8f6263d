"""Human-readable and JSON reports of a plan (used by ``bloombee-plan``)."""

from __future__ import annotations

from .baselines import BaselineResult
from .evaluate import Evaluation, HopResult
from .inputs import GIB, PlanInputs
from .search import Plan


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _codec(hop: HopResult) -> str:
    if hop.compressed:
        return f"compressed {hop.raw_bytes / hop.wire_bytes:.2f}x"
    return "raw"


def _hop_text(hop: HopResult) -> str:
    return f"{hop.raw_bytes / 1024:.0f} KiB @ {hop.bandwidth_mbps:g} Mbps + {hop.latency_s * 1e3:g} ms"


def model_summary(inputs: PlanInputs) -> dict:
    model, dtype = inputs.model, inputs.workload.dtype
    return {
        "name": model.name,
        "num_blocks": model.num_blocks,
        "hidden_size": model.hidden_size,
        "dtype": dtype,
        "weight_bytes_per_block": model.weight_bytes(dtype),
        "kv_bytes_per_token_per_block": model.kv_bytes_per_token(dtype),
        "activation_bytes_per_token": model.activation_bytes(dtype),
        "workspace_bytes_per_token": model.workspace_bytes(dtype),
    }


def stage_table(evaluation: Evaluation, gpu_names: dict[str, str] | None = None) -> list[str]:
    """One line per node (skipped ones too) and one for the client's uplink; '*' marks the bottleneck."""
    w = max([6] + [len(s.node) for s in evaluation.stages])
    header = (
        f"  {'node':<{w}} {'gpu':<10} {'blocks':>12} {'alpha':>6} {'GPU mem GiB':>14} {'host KV GiB':>12} "
        f"{'T_comp ms':>10} {'T_comm ms':>10}  next hop"
    )
    lines = [header, "  " + "-" * (len(header) - 2)]
    bottleneck = evaluation.bottleneck or ""
    hop = evaluation.client_hop
    mark = "*" if bottleneck.startswith("client ->") else " "
    lines.append(
        f"{mark} {'client':<{w}} {'':<10} {'':>12} {'':>6} {'':>14} {'':>12} {'':>10} {_ms(hop.time_s):>10}  "
        f"-> {hop.dst}: {_codec(hop)}, {_hop_text(hop)}"
    )
    for stage in evaluation.stages:
        gpu = (gpu_names or {}).get(stage.node, "")
        if not stage.active:
            lines.append(f"  {stage.node:<{w}} {gpu:<10} {'skipped':>12}")
            continue
        is_bottleneck = bottleneck == stage.node or bottleneck.startswith(f"{stage.node} (") or bottleneck.startswith(
            f"{stage.node} ->"
        )
        mark = "*" if is_bottleneck else " "
        blocks = f"{stage.start}:{stage.end} ({stage.blocks})"
        gpu_mem = f"{stage.gpu_used_bytes / GIB:.1f}/{stage.gpu_capacity_bytes / GIB:.0f}"
        host_mem = f"{stage.host_used_bytes / GIB:.1f}/{stage.host_capacity_bytes / GIB:.0f}"
        nxt = f"-> {stage.hop.dst}: {_codec(stage.hop)}, {_hop_text(stage.hop)}"
        lines.append(
            f"{mark} {stage.node:<{w}} {gpu:<10} {blocks:>12} {stage.alpha:>6.2f} {gpu_mem:>14} {host_mem:>12} "
            f"{_ms(stage.t_comp_s):>10} {_ms(stage.t_comm_s):>10}  {nxt}"
        )
    return lines


def text_report(inputs: PlanInputs, plan: Plan, baselines: dict[str, BaselineResult], simulated_s: float | None) -> str:
    ev = plan.evaluation
    model = model_summary(inputs)
    wl = inputs.workload
    lines = [
        f"model {model['name']}: {model['num_blocks']} blocks, {model['weight_bytes_per_block'] / GIB:.2f} GiB of "
        f"weights and {model['kv_bytes_per_token_per_block'] / 1024:.0f} KiB of KV per token per block ({wl.dtype}); "
        f"context {wl.seq_len}; {len(inputs.nodes)} nodes in pipeline order",
        "",
    ]
    lines += stage_table(ev, {node.name: (node.gpu or "")[:10] for node in inputs.nodes})
    kind = "sum of stage and hop times" if ev.micro_batches == 1 else f"trip + (M - 1) x cycle {ev.cycle_s * 1e3:.2f} ms"
    lines += [
        "  (* bottleneck)",
        "",
        f"chosen: batch size B={plan.batch_size}, M={plan.micro_batches} micro-batch(es) of {plan.micro_batch_size}, "
        f"{ev.num_active} active stage(s), assignment {plan.assignment}",
        f"step time {ev.step_time_s * 1e3:.1f} ms ({kind}); bottleneck: {ev.bottleneck}",
    ]
    if simulated_s is not None:
        lines.append(f"simulated micro-batch schedule: {simulated_s * 1e3:.1f} ms per step")
    compressed = [f"{h.src}->{h.dst}" for h in _hops(ev) if h.compressed]
    lines.append("compression on: " + (", ".join(compressed) if compressed else "no hop (it does not pay on these links)"))
    lines.append(f"estimated throughput: {plan.throughput:.1f} tokens/s")
    lines.append("")
    lines.append("baselines (same cost model, each at its best candidate B, M):")
    for name, label in (("even", "even split"), ("greedy", "greedy (Petals)")):
        result = baselines.get(name)
        if result is None:
            continue
        if result.evaluation is None:
            lines.append(f"  {label:<16} infeasible: {result.reason}")
        else:
            b = result.evaluation
            ratio = plan.throughput / b.throughput if b.throughput > 0 else float("inf")
            lines.append(
                f"  {label:<16} {b.throughput:8.1f} tokens/s  B={b.batch_size} M={b.micro_batches}  {b.assignment}  "
                f"(plan is {ratio:.2f}x)"
            )
    lines.append("")
    lines.append("tokens/s per candidate (rows B, columns M; - infeasible):")
    micro = sorted({c.micro_batches for c in plan.candidates})
    lines.append("  " + f"{'B':>6}" + "".join(f"{'M=' + str(m):>10}" for m in micro))
    for batch in sorted({c.batch_size for c in plan.candidates}):
        row = {c.micro_batches: c for c in plan.candidates if c.batch_size == batch}
        cells = []
        for m in micro:
            cand = row.get(m)
            cells.append(f"{cand.throughput:>10.1f}" if cand is not None and cand.throughput is not None else f"{'-':>10}")
        lines.append("  " + f"{batch:>6}" + "".join(cells))
    return "\n".join(lines)


def _hops(ev: Evaluation) -> list[HopResult]:
    return [ev.client_hop] + [s.hop for s in ev.active_stages]


def json_report(inputs: PlanInputs, plan: Plan, baselines: dict[str, BaselineResult], simulated_s: float | None) -> dict:
    return {
        "model": model_summary(inputs),
        "workload": inputs.workload.model_dump(),
        "nodes": inputs.node_names,
        "plan": plan.to_dict(),
        "compressed_hops": [f"{h.src}->{h.dst}" for h in _hops(plan.evaluation) if h.compressed],
        "simulated_step_s": simulated_s,
        "baselines": {name: result.to_dict() for name, result in baselines.items()},
    }
