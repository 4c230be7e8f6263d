"""From plans to servers and back: a node's range and weight precision in a plan, a swarm's ranges as an assignment."""

from typing import Any

from bloombee.weight_formats import QuantType, parse_quant_type


def node_range(report: dict[str, Any], node: str) -> tuple[int, int, float]:
    """Blocks [start, end) and KV offload fraction of `node` in a `bloombee-plan --json` report."""
    index = _serving_index(report, node)
    assignment = report["plan"]["assignment"]
    start = sum(assignment[:index])
    return start, start + assignment[index], float(report["plan"]["alphas"][index])


def node_quant_type(report: dict[str, Any], node: str) -> QuantType:
    """The precision the plan keeps `node`'s block weights in (`none` in a plan from before precisions were planned)."""
    index = _serving_index(report, node)
    quant_types = report["plan"].get("quant_types")
    return parse_quant_type(quant_types[index]) if quant_types else "none"


def _serving_index(report: dict[str, Any], node: str) -> int:
    """The position of `node` in a feasible plan report that gives it blocks (ValueError saying what is wrong)."""
    if not report.get("feasible", True) or "plan" not in report:
        raise ValueError(f"the plan file holds no feasible plan: {report.get('reason', 'no plan section')}")
    names, assignment = report["nodes"], report["plan"]["assignment"]
    if node not in names:
        raise ValueError(f"node {node!r} is not in the plan; its nodes are {names}: pass one of them as --node")
    index = names.index(node)
    if assignment[index] == 0:
        raise ValueError(f"the plan gives node {node!r} no blocks (it is skipped); do not start it, or plan again")
    return index


def plan_schedule(report: dict[str, Any]) -> tuple[int, int]:
    """(batch size B, micro-batches M) a `bloombee-plan --json` report planned the pipeline for."""
    return int(report["plan"]["batch_size"]), int(report["plan"]["micro_batches"])


def current_assignment(ranges: list[tuple[str, int, int]], num_blocks: int) -> tuple[list[int] | None, str]:
    """The swarm's layout as a planner assignment when it is one pipeline (ranges tile [0, L) in order)."""
    position, assignment = 0, []
    for name, start, end in ranges:
        if start != position:
            return None, f"{name} serves {start}:{end}, not starting at block {position}: the swarm is not a single pipeline"
        assignment.append(end - start)
        position = end
    if position != num_blocks:
        return None, f"the servers cover blocks 0:{position} of {num_blocks}"
    return assignment, ""
