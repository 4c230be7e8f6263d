"""``plan``: the best feasible plan over the candidate (B, M), each solved exactly by ``dp.solve``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from bloombee.weight_formats import QuantType

from .costs import StepModel, micro_batch_size
from .dp import Solution, solve
from .evaluate import Evaluation, evaluate
from .inputs import GIB, PlanInputs


class PlanInfeasibleError(ValueError):
    """No candidate (B, M) has a feasible assignment; the message says which constraint binds."""


@dataclass
class Candidate:
    batch_size: int
    micro_batches: int
    throughput: float | None
    assignment: list[int] | None
    reason: str = ""


@dataclass
class Plan:
    """The best plan over all candidate (B, M)."""

    assignment: list[int]
    batch_size: int
    micro_batches: int
    alphas: list[float]
    throughput: float
    evaluation: Evaluation
    quant_types: list[QuantType | None] = field(default_factory=list)  # per node; None where it is skipped
    candidates: list[Candidate] = field(default_factory=list)
    solve_seconds: float = 0.0

    @property
    def micro_batch_size(self) -> int:
        return micro_batch_size(self.batch_size, self.micro_batches)

    def to_dict(self) -> dict:
        return {
            "assignment": self.assignment,
            "batch_size": self.batch_size,
            "micro_batches": self.micro_batches,
            "micro_batch_size": self.micro_batch_size,
            "alphas": self.alphas,
            "quant_types": self.quant_types,
            "throughput_tokens_per_s": self.throughput,
            "solve_seconds": self.solve_seconds,
            "evaluation": self.evaluation.to_dict(),
            "candidates": [
                {
                    "batch_size": c.batch_size,
                    "micro_batches": c.micro_batches,
                    "throughput_tokens_per_s": c.throughput,
                    "assignment": c.assignment,
                    "reason": c.reason,
                }
                for c in self.candidates
            ],
        }


def plan(inputs: PlanInputs) -> Plan:
    """The best feasible plan over the workload's candidate batch sizes and micro-batch counts.

    Highest throughput wins; ties go to fewer active stages, then fewer micro-batches, then the
    smaller batch. Raises PlanInfeasibleError (saying which constraint binds) if nothing fits.
    """
    started = time.perf_counter()
    candidates, solution, model = search_candidates(inputs, solve)
    return plan_from(inputs, solution, model, candidates, solve_seconds=time.perf_counter() - started)


def search_candidates(inputs: PlanInputs, solver) -> tuple[list[Candidate], Solution, StepModel]:
    """Every candidate (B, M) solved by ``solver(inputs, B, M, step_model=...)``, the best solution and its model.

    The ranking is ``plan``'s; raises PlanInfeasibleError if no candidate has a solution.
    """
    candidates: list[Candidate] = []
    best: tuple | None = None
    for batch_size in inputs.workload.batch_sizes:
        for micro_batches in inputs.workload.micro_batches:
            if micro_batches > batch_size:
                reason = f"micro_batches {micro_batches} > batch_size {batch_size}"
                candidates.append(Candidate(batch_size, micro_batches, None, None, reason))
                continue
            model = StepModel(inputs, batch_size, micro_batches)
            solution = solver(inputs, batch_size, micro_batches, step_model=model)
            if solution is None:
                candidates.append(Candidate(batch_size, micro_batches, None, None, capacity_report(model)))
                continue
            candidates.append(Candidate(batch_size, micro_batches, solution.throughput, solution.assignment))
            key = (-solution.throughput, solution.num_active, micro_batches, batch_size)
            if best is None or key < best[0]:
                best = (key, solution, model)
    if best is None:
        raise PlanInfeasibleError(infeasible_message(inputs))
    return candidates, best[1], best[2]


def plan_from(inputs: PlanInputs, solution: Solution, model: StepModel, candidates: list[Candidate],
              solve_seconds: float = 0.0) -> Plan:
    """The plan of ``solution``, scored by ``evaluate``."""
    evaluation = evaluate(inputs, solution.assignment, solution.batch_size, solution.micro_batches, step_model=model)
    return Plan(
        assignment=solution.assignment,
        batch_size=solution.batch_size,
        micro_batches=solution.micro_batches,
        alphas=evaluation.alphas,
        throughput=evaluation.throughput,
        evaluation=evaluation,
        quant_types=evaluation.quant_types,
        candidates=candidates,
        solve_seconds=solve_seconds,
    )


@dataclass
class PrecisionOption:
    """The best plan when the nodes may keep their weights in `quant` (nodes with a fixed precision keep theirs)."""

    quant: list[QuantType]
    plan: Plan | None
    reason: str = ""


def compare_precisions(inputs: PlanInputs, best: Plan) -> list[PrecisionOption]:
    """The best plan with each allowed precision alone, then with all of them (`best`, the plan of `inputs`)."""
    options = []
    for quant in inputs.workload.quant:
        alone = inputs.model_copy(update={"workload": inputs.workload.model_copy(update={"quant": [quant]})})
        try:
            options.append(PrecisionOption([quant], plan(alone)))
        except PlanInfeasibleError as exc:
            options.append(PrecisionOption([quant], None, str(exc)))
    return options + [PrecisionOption(list(inputs.workload.quant), best)]


def capacity_report(model: StepModel) -> str:
    """Why no assignment fits at this (B, M): how many blocks each node can hold and what binds."""
    caps = model.capacity()
    total = int(caps.sum())
    parts = []
    for j, spec in enumerate(model.inputs.nodes):
        cap = int(caps[j])
        if cap >= model.num_blocks:
            parts.append(f"{spec.name}: all {model.num_blocks}")
        else:
            parts.append(f"{spec.name}: {cap} ({model.explain_capacity(j, cap + 1)})")
    return (
        f"at batch size {model.batch_size} (micro-batch {model.b}, context {model.seq_len}) the nodes hold at most "
        f"{total} of the {model.num_blocks} blocks; per node: " + "; ".join(parts)
    )


def infeasible_message(inputs: PlanInputs) -> str:
    """The message for a model that fits nowhere, at the most favourable candidate (smallest B, largest M <= B)."""
    batch = min(inputs.workload.batch_sizes)
    micro = max([m for m in inputs.workload.micro_batches if m <= batch], default=None)
    if micro is None:
        return (
            f"no feasible plan: every candidate micro-batch count {inputs.workload.micro_batches} exceeds every "
            f"batch size {inputs.workload.batch_sizes}"
        )
    model = StepModel(inputs, batch, micro)
    compact = int(np.argmin(model.weight_bytes))
    kept = "" if model.precisions[compact] == "none" else f" in {model.precisions[compact]}"
    lines = [f"no feasible plan for any candidate batch size / micro-batch count: {capacity_report(model)}."]
    if all(model.explain_capacity(j, 1).startswith("GPU memory") for j in range(model.num_nodes)):
        lines.append(
            f"The binding constraint is GPU memory: one block's weights{kept} ({model.weight_bytes[compact] / GIB:.2f} "
            "GiB) plus workspace do not fit any node."
        )
    else:
        binding = {model.explain_capacity(j, int(c) + 1).split(":")[0] for j, c in enumerate(model.capacity()) if c < model.num_blocks}
        lines.append(
            "Binding: " + " and ".join(sorted(binding)) + " (KV cache that does not fit the GPU is offloaded to host "
            "memory; weights and workspace must fit the GPU). Add nodes or memory, or shorten seq_len / the batch."
        )
    return " ".join(lines)
