"""Brute force: score every contiguous assignment with ``evaluate``. For checking the DP on small cases."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from .costs import StepModel
from .search import Candidate, Plan, PlanInfeasibleError, capacity_report, infeasible_message
from .evaluate import evaluate
from .inputs import PlanInputs


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as an ordered sum of `parts` non-negative integers."""
    for bars in itertools.combinations(range(total + parts - 1), parts - 1):
        previous = -1
        out = []
        for bar in bars:
            out.append(bar - previous - 1)
            previous = bar
        out.append(total + parts - 1 - previous - 1)
        yield tuple(out)


def brute_force(inputs: PlanInputs) -> Plan:
    """The best plan by exhaustive enumeration (C(L + N - 1, N - 1) assignments per (B, M)).

    Same tie-breaking as ``plan``; raises PlanInfeasibleError if nothing fits.
    """
    best = None
    candidates = []
    for batch_size in inputs.workload.batch_sizes:
        for micro_batches in inputs.workload.micro_batches:
            if micro_batches > batch_size:
                candidates.append(Candidate(batch_size, micro_batches, None, None, "micro_batches > batch_size"))
                continue
            model = StepModel(inputs, batch_size, micro_batches)
            local = None
            for assignment in compositions(inputs.num_blocks, len(inputs.nodes)):
                result = evaluate(inputs, assignment, batch_size, micro_batches, step_model=model)
                if not result.feasible:
                    continue
                key = (-result.throughput, result.num_active, micro_batches, batch_size)
                if local is None or key < local[0]:
                    local = (key, result)
            if local is None:
                candidates.append(Candidate(batch_size, micro_batches, None, None, capacity_report(model)))
                continue
            candidates.append(Candidate(batch_size, micro_batches, local[1].throughput, local[1].assignment))
            if best is None or local[0] < best[0]:
                best = local
    if best is None:
        raise PlanInfeasibleError(infeasible_message(inputs))
    result = best[1]
    return Plan(
        assignment=result.assignment,
        batch_size=result.batch_size,
        micro_batches=result.micro_batches,
        alphas=result.alphas,
        throughput=result.throughput,
        evaluation=result,
        candidates=candidates,
    )
