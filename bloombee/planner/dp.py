"""The exact dynamic program over contiguous block ranges for one (B, M): ``solve``.

Nodes are in pipeline order; node j holds L_j >= 0 consecutive blocks, the ranges follow each other
in node order, and a node with L_j = 0 drops out together with its hops (the chain goes from the
previous active node straight to the next one). Only the nodes that can hold at least one block at
this (B, M) take part; the others are skipped in every feasible plan anyway.

Indices: j and p are nodes, k the number of blocks placed so far (0..L), l the blocks of one stage,
n the number of active stages, comp[j, l] a stage's compute time (inf where it does not fit),
hop[p, j] the hop time from p to j (the client is both the first sender and the last receiver).

One recurrence, parameterised by its objective (``_Objective``): ``op`` combines the times along a
placement, + for the sum of stage and hop times (M = 1, eq. 1), max for the bottleneck cycle
(M >= 2, eq. 4). State (n, k, j): blocks [0, k) placed on n active stages, node j the last one,
ending at block k; its value excludes j's outgoing hop, known only once the next node is chosen.

    arrive[1, 0, j] = hop[client, j]
    arrive[n, k, j] = min_{p < j} op(F[n - 1, k, p], hop[p, j])                      (n > 1)
    F[n, k, j]      = min_{1 <= l <= k} op(arrive[n, k - l, j], comp[j, l])
    C_n             = min_j op(F[n, L, j], hop[j, client])
    T_step          = min_n scale(n) * C_n

With the bottleneck, scale(n) = M + n - 1 (fill and drain), so the tables keep one layer per stage
count (``_Objective.layered``; so do capped stage counts). With the plain sum, scale(n) = 1 and the
layers collapse into one: arrive[k, j] = min(hop[client, j] if k = 0, min_{p < j} op(F[k, p],
hop[p, j])), O(N L^2 + N^2 L).

Two sweep orders compute the same tables (``_tables``): node by node with every layer at once
(collapsed tables and small problems), or layer by layer with all nodes at once (large layered
ones). The second stops early. A placement on more than n stages has a value of at least
min_{k < L} F[n, k, j] (its first n stages are a state of layer n), at least the best bottleneck
over any number of stages, and at least a compute-only bound for its number of stages
(``_lower_bounds``; a sum of times is at least their max); once min over n' > n of scale(n') times
the largest of these reaches the best T_step, no deeper layer can win. Likewise a state whose value
times scale(n + 1) reaches it is dropped. One walk-back (``_walk_back``) recovers the stages from
either sweep.

Many assignments often share the bottleneck optimum; ``search.plan`` reruns the DP on its winner
with + in place of max, every time above the optimum's cycle masked out and at most its number of
stages (``solve(..., refine=True)``), to return the equally fast assignment whose stage and hop
times add up least.

The program is exact for the model in ``costs``/``evaluate``: every contiguous assignment is a
path through the states, and a path's value is the assignment's step time computed with the same
floating-point operations in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .costs import StepModel
from .inputs import PlanInputs

# Layered problems of at most this many (node, blocks) cells are swept node by node with all stage
# counts at once; larger ones layer by layer with early stopping. Both are exact; the tests run both.
SMALL_LAYER_CELLS = 4096
# Above this many usable nodes the layer-by-layer sweep first computes lower bounds to stop early.
PRUNE_BOUNDS_MIN_NODES = 8


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


@dataclass(frozen=True)
class _Objective:
    """How times combine along a placement (``op``: np.add or np.maximum) and what it costs.

    With ``fill`` = M a placement of value C on n stages takes (M + n - 1) C, otherwise C;
    ``max_stages`` caps n.
    """

    op: np.ufunc
    fill: int | None = None
    max_stages: int | None = None

    @property
    def layered(self) -> bool:
        """Whether the tables need one layer per stage count (the cost or a cap depends on it)."""
        return self.fill is not None or self.max_stages is not None

    def depth(self, problem: _Problem) -> int:
        """The number of layers of the tables."""
        if not self.layered:
            return 1
        return min(self.max_stages or problem.count, problem.count, problem.num_blocks)

    def scale(self, depth: int) -> np.ndarray:
        """The factor of each stage count 1..depth."""
        return np.ones(depth) if self.fill is None else self.fill + np.arange(depth)


# ------------------------------------------------------------------------------------------ solve


def solve(
    inputs: PlanInputs,
    batch_size: int,
    micro_batches: int,
    step_model: StepModel | None = None,
    refine: bool = False,
) -> Solution | None:
    """The exact best contiguous assignment for one (B, M), or None if none is feasible.

    With ``refine`` (M >= 2) a second, masked DP then picks, among the assignments on at most as
    many stages as the optimum found and with every stage and hop time within its cycle (all
    equally optimal), one with the smallest sum of times: no needless offloading or detours.
    ``plan`` refines its winner.
    """
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
    objective = _Objective(np.add) if micro_batches == 1 else _Objective(np.maximum, fill=micro_batches)
    found = _optimum(problem, objective)
    if found is None:
        return None
    step_time, path, cycle = found
    if refine and micro_batches > 1:
        shorter = _optimum(problem.within(cycle), _Objective(np.add, max_stages=len(path)))
        path = shorter[1] if shorter is not None else path
    assignment = [0] * model.num_nodes
    for j, blocks in path:
        assignment[int(usable[j])] = blocks
    return Solution(batch_size, micro_batches, assignment, step_time, len(path))


def _optimum(problem: _Problem, objective: _Objective):
    """(T_step, stages [(j, l), ...], the value C_n before scaling) of the best placement, or None.

    Ties go to fewer stages (in layered tables), then to the earlier last node.
    """
    states, arrivals = _tables(problem, objective)
    ends = _ends(problem, objective.op, states)  # [n - 1, j]
    cycles = ends.min(axis=1)
    values = objective.scale(cycles.size) * cycles
    n = int(np.argmin(values))
    if not math.isfinite(values[n]):
        return None
    j = int(np.argmin(ends[n]))
    return float(values[n]), _walk_back(problem, objective, states, arrivals, j, n), float(cycles[n])


def _ends(problem: _Problem, op, states: np.ndarray) -> np.ndarray:
    """C per layer and last node: op(F[n, L, j], hop[j, client]) for states [j, n, k] (or [j, k])."""
    return op(states[..., problem.num_blocks].T, problem.hop[: problem.count, problem.count])


def _walk_back(problem: _Problem, objective: _Objective, states, arrivals, j: int, n: int) -> list[tuple[int, int]]:
    """The stages [(j, l), ...] of the placement ending with node j in layer n, recomputing each argmin."""
    op, shift = objective.op, int(objective.layered)
    path = []
    k = problem.num_blocks
    while True:
        l = _best_length(arrivals[j, n], problem.comp[j], int(problem.caps[j]), k, op)
        path.append((j, l))
        k -= l
        if k == 0:  # F[., 0] is inf: the stage that starts at block 0 is entered from the client
            break
        n -= shift
        j = int(np.argmin(op(states[:j, n, k], problem.hop[:j, j])))
    path.reverse()
    return path


def _best_length(arrive: np.ndarray, comp: np.ndarray, cap: int, k: int, op) -> int:
    """A stage length l (1..min(cap, k)) attaining min_l op(arrive[k - l], comp[l])."""
    longest = min(cap, k)
    values = op(arrive[k - longest : k][::-1], comp[1 : longest + 1])  # l = 1..longest
    return int(np.argmin(values)) + 1


# ----------------------------------------------------------------------------------- the tables


def _tables(problem: _Problem, objective: _Objective) -> tuple[np.ndarray, np.ndarray]:
    """(F, arrive) as arrays [j, n - 1, k]; a layer-by-layer sweep may stop before the last layer."""
    if objective.layered and problem.count * (problem.num_blocks + 1) > SMALL_LAYER_CELLS:
        return _by_layer(problem, objective)
    return _by_node(problem, objective)


class _Stage:
    """The stage step F[r, k] = min over l = 1..cap of op(arrive[r, k - l], comp[r, l]) for rows of
    arrivals, through one padded buffer per sweep (rows at most ``rows``, cap at most ``width``)."""

    def __init__(self, op, rows: int, width: int, size: int):
        self.op, self.width = op, width
        self.pad = np.full((rows, width + size), np.inf)
        row, col = self.pad.strides
        # windows[t, r, k] = pad[r, k + t] = arrive[r, k - l] with l = width - t
        self.windows = as_strided(self.pad, shape=(width, rows, size), strides=(col, row, col))

    def __call__(self, arrive: np.ndarray, comp: np.ndarray, cap: int) -> np.ndarray:
        """F for arrive (R, S <= size) and comp (R or 1, L + 1)."""
        rows, size = arrive.shape
        self.pad[:rows, self.width : self.width + size] = arrive
        return self.op(self.windows[self.width - cap :, :rows, :size], comp[:, cap:0:-1].T[:, :, None]).min(axis=0)


def _enter(op, states: np.ndarray, hops: np.ndarray) -> np.ndarray:
    """arrive[x, k] = min over p of op(states[p, x, k], hops[p, x]) (either may broadcast over x)."""
    return op(states, hops[:, :, None]).min(axis=0)


def _by_node(problem: _Problem, objective: _Objective) -> tuple[np.ndarray, np.ndarray]:
    """The tables node by node, every layer at once."""
    op, count, hop, comp = objective.op, problem.count, problem.hop, problem.comp
    depth, shift = objective.depth(problem), int(objective.layered)
    states = np.full((count, depth, problem.num_blocks + 1), np.inf)
    arrivals = np.full(states.shape, np.inf)
    arrivals[:, 0, 0] = hop[count, :count]
    stage = _Stage(op, depth, int(problem.caps.max()), problem.num_blocks + 1)
    for j, cap in enumerate(problem.caps.tolist()):
        top = min(j + 1, depth)  # node j is at most the (j + 1)-th stage
        if j and top > shift:
            target = arrivals[j, shift:top]
            np.minimum(target, _enter(op, states[:j, : top - shift], hop[:j, j, None]), out=target)
        states[j, :top] = stage(arrivals[j, :top], comp[j, None], cap)
    return states, arrivals


def _by_layer(problem: _Problem, objective: _Objective) -> tuple[np.ndarray, np.ndarray]:
    """The layered tables one stage count at a time, all nodes at once, while a deeper layer can still win."""
    op, count, hop, num_blocks = objective.op, problem.count, problem.hop, problem.num_blocks
    depth = objective.depth(problem)
    scale = objective.scale(depth)
    lower = _lower_bounds(problem, depth) if count > PRUNE_BOUNDS_MIN_NODES else np.zeros(depth)
    into = np.where(np.triu(np.ones((count, count), bool), 1), hop[:count, :count], np.inf)  # only p < j
    width = int(problem.caps.max())
    stage = _Stage(op, count, width, num_blocks + 1)
    states = np.empty((depth, count, num_blocks + 1))
    arrivals = np.empty(states.shape)
    arrivals[0] = np.inf
    arrivals[0, :, 0] = hop[count, :count]
    best = math.inf
    for n in range(depth):  # layer n: n + 1 stages
        if n:
            arrivals[n] = np.inf
            rows, cols = _finite_span(states[n - 1, :, :num_blocks])
            arrivals[n, :, cols] = _enter(op, states[n - 1, rows, None, cols], into[rows])
        rows, cols = _finite_span(arrivals[n])
        states[n] = np.inf
        states[n, rows, cols.start :] = stage(arrivals[n, rows, cols.start :], problem.comp[rows], width)
        f = states[n]
        best = min(best, scale[n] * _ends(problem, op, f).min())
        if n + 1 == depth:
            break
        head = f[:, :num_blocks]
        head[scale[n + 1] * head >= best] = np.inf  # such a state cannot lead to a better plan
        partial = head.min()
        if not math.isfinite(partial) or np.min(scale[n + 1 :] * np.maximum(lower[n + 1 :], partial)) >= best:
            break
    return states[: n + 1].transpose(1, 0, 2), arrivals[: n + 1].transpose(1, 0, 2)


def _finite_span(values: np.ndarray) -> tuple[np.ndarray, slice]:
    """The rows with a finite entry and the columns from the first finite entry to the last."""
    finite = np.isfinite(values)
    rows = np.flatnonzero(finite.any(axis=1))
    cols = np.flatnonzero(finite.any(axis=0))
    return rows, slice(int(cols[0]), int(cols[-1]) + 1) if cols.size else slice(0, 0)


def _lower_bounds(problem: _Problem, depth: int) -> np.ndarray:
    """lower[n - 1] <= the bottleneck (so also the sum of times) of any placement on n stages."""
    states, _ = _by_node(problem, _Objective(np.maximum))  # any number of stages
    best_any = _ends(problem, np.maximum, states).min()
    return np.maximum(_compute_bounds(problem.comp, problem.num_blocks, depth), best_any)


def _compute_bounds(comp: np.ndarray, num_blocks: int, max_layers: int, grid_size: int = 256) -> np.ndarray:
    """lower[n' - 1] <= the bottleneck of any placement on n' stages, from compute alone.

    Under a bottleneck C node j holds at most lmax_j(C) = max{l : comp[j, l] <= C} blocks, so n'
    stages cover at most the sum of the n' largest lmax_j(C); the bound is the largest C (on a grid
    of the comp values) at which that sum is still below L. Hops are ignored, so it is a lower bound.
    """
    suffix_min = np.minimum.accumulate(comp[:, :0:-1], axis=1)[:, ::-1]  # [j, l - 1] = min_{l' >= l} comp[j, l']
    values = np.unique(suffix_min[np.isfinite(suffix_min)])
    if values.size == 0:
        return np.full(max_layers, np.inf)
    grid = values if values.size <= grid_size else np.unique(np.quantile(values, np.linspace(0, 1, grid_size)))
    lmax = np.stack([np.searchsorted(row, grid, side="right") for row in suffix_min], axis=1)  # (G, K)
    top = -np.sort(-lmax, axis=1)
    cover = np.cumsum(top, axis=1)[:, :max_layers]  # [g, n' - 1]
    if cover.shape[1] < max_layers:
        cover = np.pad(cover, ((0, 0), (0, max_layers - cover.shape[1])), mode="edge")
    short = (cover < num_blocks).sum(axis=0)  # cover grows with C: a prefix of the grid is short
    bound = np.where(short > 0, grid[np.maximum(short - 1, 0)], 0.0)  # the true minimum is above it
    bound[short == grid.size] = np.inf  # n' stages cannot hold the model at all
    return bound
