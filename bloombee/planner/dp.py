"""The exact dynamic program over contiguous block ranges for one (B, M): ``solve``.

Nodes are in pipeline order; node j holds L_j >= 0 consecutive blocks, the ranges follow each other
in node order, and a node with L_j = 0 drops out together with its hops (the chain goes from the
previous active node straight to the next one). Only the nodes that can hold at least one block at
this (B, M) take part; the others are skipped in every feasible plan anyway.

The objective is ``evaluate``'s step time: one micro-batch's trip S (the sum of its hop and stage
times) plus (M - 1) times the slowest of those times C, the makespan of M identical micro-batches
through the chain's resources in order (the event simulation's, before cores are shared).

Indices: j and p are nodes, k the number of blocks placed so far (0..L), l the blocks of one stage,
comp[j, l] a stage's compute time (inf where it does not fit) in node j's best weight precision for l
blocks (``StepModel.comp_table``: a precision changes only its own stage's time and memory, and the
step time grows with every stage's time, so the best precision per stage is part of an optimum),
hop[p, j] the hop time from p to j (the client is both the first sender and the last receiver).
``op`` combines the times along a placement: + for S, max for C. State (k, j): blocks [0, k) placed,
node j the last stage, ending at block k; its value excludes j's outgoing hop, known only once the
next node is chosen.

    arrive[0, j] = hop[client, j]
    arrive[k, j] = min_{p < j} op(F[k, p], hop[p, j])                          (k > 0)
    F[k, j]      = min_{1 <= l <= k} op(arrive[k - l, j], comp[j, l])
    value        = min_j op(F[L, j], hop[j, client])

in O(N L^2 + N^2 L). With M = 1 the value of + is the step time. With M >= 2 the optimum is on the
front of placements that no other beats in both S and C: starting from the least S over all
placements, each next + program keeps only the times below the last placement's C (the largest
distinct stage or hop time under it) and gives the least S among placements with a smaller cycle.
The best S + (M - 1) C along the front is the optimum (a placement off it has a front placement
with S and C no larger). As S only grows along the front, a next placement can beat the best found
only with C < (best - S) / (M - 1): each cap is the smaller of that and the largest time under the
last C, and the walk stops below the least possible C (the max program's value).

The program is exact for the model in ``costs``/``evaluate``: every contiguous assignment is a
path through the states, and the step time of the placement found is computed with the same
floating-point operations in the same order as ``evaluate``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .costs import StepModel
from .inputs import PlanInputs

@dataclass
class Solution:
    """The best assignment for one (B, M) as found by the DP."""

    batch_size: int
    micro_batches: int
    assignment: list[int]
    step_time_s: float
    num_active: int

    @property
    def throughput(self) -> float:
        return self.batch_size / self.step_time_s


@dataclass(frozen=True)
class _Problem:
    """The usable nodes' stage times and the hops between them (client last)."""

    comp: np.ndarray  # (K, L + 1): comp[j, l], inf at l = 0 and where l blocks do not fit
    hop: np.ndarray  # (K + 1, K + 1)
    caps: np.ndarray  # (K,): the most blocks each node holds

    @property
    def count(self) -> int:
        return self.comp.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.comp.shape[1] - 1

    def within(self, cycle: float) -> _Problem:
        """The same problem with every stage and hop time above ``cycle`` masked out."""
        comp = np.where(self.comp <= cycle, self.comp, np.inf)
        return _Problem(comp, np.where(self.hop <= cycle, self.hop, np.inf), self.caps)


# ------------------------------------------------------------------------------------------ solve


def solve(
    inputs: PlanInputs,
    batch_size: int,
    micro_batches: int,
    step_model: StepModel | None = None,
) -> Solution | None:
    """The exact best contiguous assignment for one (B, M), or None if none is feasible."""
    if micro_batches > batch_size:
        return None
    model = step_model or StepModel(inputs, batch_size, micro_batches)
    full_comp, caps = model.comp_table()
    usable = np.flatnonzero(caps >= 1)
    if caps[usable].sum() < model.num_blocks:
        return None
    comp = full_comp[usable]  # a copy
    comp[:, 0] = np.inf
    hop_index = np.append(usable, model.client)
    problem = _Problem(comp, model.hop[np.ix_(hop_index, hop_index)], caps[usable])
    found = _best_pipelined(problem, micro_batches)
    if found is None:
        return None
    step_time, path = found
    assignment = [0] * model.num_nodes
    for j, blocks in path:
        assignment[int(usable[j])] = blocks
    return Solution(batch_size, micro_batches, assignment, step_time, len(path))


def _best_pipelined(problem: _Problem, micro_batches: int) -> tuple[float, list[tuple[int, int]]] | None:
    """(step time, stages) of the placement with the least S + (M - 1) C, or None."""
    found = _optimum(problem, np.add)
    if found is None or micro_batches == 1:
        return None if found is None else (_step_time(problem, found[1], micro_batches), found[1])
    least_cycle = _optimum(problem, np.maximum)[0]
    tightest = _optimum(problem.within(least_cycle), np.add)[1]  # the least S among the least cycles: a good start
    best = min((_step_time(problem, path, micro_batches), path) for path in (found[1], tightest))
    times = np.unique(np.concatenate([problem.comp[np.isfinite(problem.comp)], problem.hop[np.isfinite(problem.hop)]]))
    while True:
        # the next placement on the front has a shorter cycle and an S no smaller, so it beats the best only with a
        # cycle under (best - S) / (M - 1)
        cap = min(_trip_and_cycle(problem, found[1])[1] * (1 - 1e-12), (best[0] - found[0]) / (micro_batches - 1))
        below = times[times <= cap]
        if below.size == 0 or below[-1] < least_cycle:
            return best
        found = _optimum(problem.within(float(below[-1])), np.add)
        best = min(best, (_step_time(problem, found[1], micro_batches), found[1]))


def _trip_and_cycle(problem: _Problem, path: list[tuple[int, int]]) -> tuple[float, float]:
    """(S, C) of a placement: the sum of its stage and hop times, in ``evaluate``'s order, and the slowest of them."""
    nodes = [j for j, _ in path] + [problem.count]
    total = cycle = float(problem.hop[problem.count, nodes[0]])
    for (j, blocks), successor in zip(path, nodes[1:]):
        compute, transfer = float(problem.comp[j, blocks]), float(problem.hop[j, successor])
        total = total + compute
        total = total + transfer
        cycle = max(cycle, compute, transfer)
    return total, cycle


def _step_time(problem: _Problem, path: list[tuple[int, int]], micro_batches: int) -> float:
    """S + (M - 1) C of a placement, in ``evaluate``'s order of operations."""
    total, cycle = _trip_and_cycle(problem, path)
    return total if micro_batches == 1 else total + (micro_batches - 1) * cycle


def _optimum(problem: _Problem, op) -> tuple[float, list[tuple[int, int]]] | None:
    """(value, stages [(j, l), ...]) of the best placement under ``op``, or None. Ties go to the earlier last node."""
    states, arrivals = _by_node(problem, op)
    ends = _ends(problem, op, states)
    j = int(np.argmin(ends))
    if not math.isfinite(ends[j]):
        return None
    return float(ends[j]), _walk_back(problem, op, states, arrivals, j)


def _ends(problem: _Problem, op, states: np.ndarray) -> np.ndarray:
    """The value per last node: op(F[L, j], hop[j, client]) for states [j, k]."""
    return op(states[:, problem.num_blocks], problem.hop[: problem.count, problem.count])


def _walk_back(problem: _Problem, op, states, arrivals, j: int) -> list[tuple[int, int]]:
    """The stages [(j, l), ...] of the placement ending with node j, recomputing each argmin."""
    path = []
    k = problem.num_blocks
    while True:
        l = _best_length(arrivals[j], problem.comp[j], int(problem.caps[j]), k, op)
        path.append((j, l))
        k -= l
        if k == 0:  # F[0, .] is inf: the stage that starts at block 0 is entered from the client
            break
        j = int(np.argmin(op(states[:j, k], problem.hop[:j, j])))
    path.reverse()
    return path


def _best_length(arrive: np.ndarray, comp: np.ndarray, cap: int, k: int, op) -> int:
    """A stage length l (1..min(cap, k)) attaining min_l op(arrive[k - l], comp[l])."""
    longest = min(cap, k)
    values = op(arrive[k - longest : k][::-1], comp[1 : longest + 1])  # l = 1..longest
    return int(np.argmin(values)) + 1


# ----------------------------------------------------------------------------------- the tables


class _Stage:
    """The stage step F[k] = min over l = 1..cap of op(arrive[k - l], comp[l]) through one padded buffer (cap at
    most ``width``)."""

    def __init__(self, op, width: int, size: int):
        self.op, self.width = op, width
        self.pad = np.full(width + size, np.inf)
        (col,) = self.pad.strides
        # windows[t, k] = pad[k + t] = arrive[k - l] with l = width - t
        self.windows = as_strided(self.pad, shape=(width, size), strides=(col, col))

    def __call__(self, arrive: np.ndarray, comp: np.ndarray, cap: int) -> np.ndarray:
        """F for one node's arrive (L + 1) and comp (L + 1)."""
        self.pad[self.width :] = arrive
        return self.op(self.windows[self.width - cap :], comp[cap:0:-1, None]).min(axis=0)


def _by_node(problem: _Problem, op) -> tuple[np.ndarray, np.ndarray]:
    """(F, arrive) as arrays [j, k], node by node."""
    count, hop, comp = problem.count, problem.hop, problem.comp
    states = np.full((count, problem.num_blocks + 1), np.inf)
    arrivals = np.full(states.shape, np.inf)
    arrivals[:, 0] = hop[count, :count]
    stage = _Stage(op, int(problem.caps.max()), problem.num_blocks + 1)
    for j, cap in enumerate(problem.caps.tolist()):
        if j:
            np.minimum(arrivals[j], op(states[:j], hop[:j, j, None]).min(axis=0), out=arrivals[j])
        states[j] = stage(arrivals[j], comp[j], cap)
    return states, arrivals
