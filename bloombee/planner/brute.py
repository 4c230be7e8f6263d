"""Brute force: score every contiguous assignment with ``evaluate``. For checking the DP on small cases."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from .costs import StepModel
from .dp import Solution
from .evaluate import evaluate
from .inputs import PlanInputs
from .search import Plan, plan_from, search_candidates


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

    Same candidates and tie-breaking as ``plan``; raises PlanInfeasibleError if nothing fits.
    """
    candidates, solution, model = search_candidates(inputs, enumerate_best)
    return plan_from(inputs, solution, model, candidates)


def enumerate_best(inputs: PlanInputs, batch_size: int, micro_batches: int, step_model: StepModel) -> Solution | None:
    """The best assignment for one (B, M) over every contiguous one; ties go to fewer active stages."""
    best, best_key = None, None
    for assignment in compositions(inputs.num_blocks, len(inputs.nodes)):
        result = evaluate(inputs, assignment, batch_size, micro_batches, step_model=step_model)
        key = (-result.throughput, result.num_active)
        if result.feasible and (best is None or key < best_key):
            best, best_key = result, key
    if best is None:
        return None
    return Solution(batch_size, micro_batches, best.assignment, best.step_time_s, best.num_active)
