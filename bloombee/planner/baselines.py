"""Baselines scored by the same evaluator: an even split and a Petals-style greedy placement.

- even split: the L blocks over all N nodes in pipeline order, floor(L / N) each and one more for
  the first L mod N nodes (a node whose share does not fit makes the plan infeasible).
- greedy (Petals' block selection): each node in pipeline order takes the largest number of blocks
  it can hold without offloading (in any of its candidate precisions), placed on the contiguous
  window that covers the least-served blocks (Petals' rule: the window whose sorted per-block
  service is lexicographically smallest, service = the sum of 1 / t_block of the nodes covering a
  block, t_block in the node's fastest precision; ties go to the earliest window).
  The client then chains through the nodes in pipeline order, taking from each the part of its
  window that extends the covered prefix; a gap left uncovered makes the plan infeasible.

Each baseline is scored over the same candidate (B, M) grid as the planner and reported at its best.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .costs import StepModel
from .evaluate import Evaluation, evaluate
from .inputs import PlanInputs


def even_split(inputs: PlanInputs) -> list[int]:
    count, blocks = len(inputs.nodes), inputs.num_blocks
    base, extra = divmod(blocks, count)
    return [base + (1 if j < extra else 0) for j in range(count)]


def greedy(inputs: PlanInputs, batch_size: int, micro_batches: int = 1, step_model: StepModel | None = None) -> tuple[list[int] | None, str]:
    """Petals-style greedy assignment at this batch size: (assignment, '') or (None, why not)."""
    model = step_model or StepModel(inputs, batch_size, micro_batches)
    total = model.num_blocks
    caps = np.minimum(model.capacity(offload=False), total)
    # a block's time without offloading, in the node's fastest candidate precision
    block_s = np.where(model.allowed, model.t_mlp + model.t_attn_gpu, np.inf).min(axis=0)
    served = np.zeros(total)
    windows = []
    for j in range(model.num_nodes):
        cap = int(caps[j])
        if cap <= 0:
            windows.append(None)
            continue
        options = [(sorted(served[s : s + cap]), s) for s in range(total - cap + 1)]
        start = min(options)[1]
        windows.append((start, start + cap))
        served[start : start + cap] += 1.0 / block_s[j] if block_s[j] > 0 else 1e12
    assignment = [0] * model.num_nodes
    covered = 0
    for j, window in enumerate(windows):
        if window is None:
            continue
        start, end = window
        if start <= covered < end:
            assignment[j] = end - covered
            covered = end
    if covered < total:
        return None, (
            f"greedy placement leaves blocks [{covered}, {total}) without a server in pipeline order "
            f"at batch size {batch_size} (capacities without offloading: {caps.tolist()})"
        )
    return assignment, ""


@dataclass
class BaselineResult:
    name: str
    evaluation: Evaluation | None  # the best feasible (B, M); None if none is
    reason: str = ""

    @property
    def throughput(self) -> float:
        return self.evaluation.throughput if self.evaluation is not None else 0.0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "throughput_tokens_per_s": self.throughput if self.evaluation is not None else None,
            "batch_size": self.evaluation.batch_size if self.evaluation else None,
            "micro_batches": self.evaluation.micro_batches if self.evaluation else None,
            "assignment": self.evaluation.assignment if self.evaluation else None,
            "reason": self.reason,
        }


def baselines(inputs: PlanInputs) -> dict[str, BaselineResult]:
    """Even split and greedy, each at its best candidate (B, M)."""
    results = {}
    for name in ("even", "greedy"):
        best, reasons = None, []
        for batch_size in inputs.workload.batch_sizes:
            for micro_batches in inputs.workload.micro_batches:
                if micro_batches > batch_size:
                    continue
                model = StepModel(inputs, batch_size, micro_batches)
                if name == "even":
                    assignment, why = even_split(inputs), ""
                else:
                    assignment, why = greedy(inputs, batch_size, micro_batches, step_model=model)
                if assignment is None:
                    reasons.append(why)
                    continue
                result = evaluate(inputs, assignment, batch_size, micro_batches, step_model=model)
                if not result.feasible:
                    reasons.append(f"B={batch_size}, M={micro_batches}: {result.reason}")
                    continue
                if best is None or result.throughput > best.throughput:
                    best = result
        reason = "" if best is not None else (reasons[0] if reasons else "no candidate (B, M)")
        results[name] = BaselineResult(name, best, reason)
    return results
