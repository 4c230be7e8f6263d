"""The exact dynamic program over contiguous block ranges for one (B, M): ``solve``.

Nodes are in pipeline order; node j holds L_j >= 0 consecutive blocks, the ranges follow each other
in node order, and a node with L_j = 0 drops out together with its hops (the chain goes from the
previous active node straight to the next one). Only the nodes that can hold at least one block at
this (B, M) take part; the others are skipped in every feasible plan anyway.

Indices: j and p are nodes, k the number of blocks assigned so far (0..L), l the blocks of one
stage, comp[j, l] its compute time (inf where it does not fit), hop[p, j] the hop time from p to j
(the client is both the first sender and the last receiver).

M = 1, the sum objective (T_step = sum of all stage and hop times). State (k, j): blocks [0, k) are
placed and node j is the last active node, ending at block k; the value excludes j's outgoing hop,
which only becomes known when the next active node is chosen.

    arrive[k, j] = min(hop[client, j] if k = 0,  min_{p < j} f[k, p] + hop[p, j])
    f[k, j]      = min_{1 <= l <= k} arrive[k - l, j] + comp[j, l]
    T_step       = min_j f[L, j] + hop[j, client]

O(N L^2 + N^2 L) per (B, M); the loop over j is sequential, the rest vectorised.

M >= 2, the bottleneck objective (T_step = (M + N' - 1) * max of all stage and hop times). The max
alone would be a plain min-max DP, but the fill/drain factor depends on N', the number of active
stages, so the DP is layered by it: layer n holds, for every (k, j), the smallest bottleneck so far
of any placement of blocks [0, k) on exactly n active stages ending at node j.

    arrive_n[k, j] = hop[client, j] if n = 1 and k = 0;   min_{p < j} max(F_{n-1}[k, p], hop[p, j]) if n > 1
    F_n[k, j]      = min_{1 <= l <= k} max(arrive_n[k - l, j], comp[j, l])
    C_n            = min_j max(F_n[L, j], hop[j, client])
    T_step         = min_n (M + n - 1) * C_n

Small problems compute all layers together, node by node (``_by_node``); large ones one layer at a
time, each a vectorised step over all (k, j) (O(N^2 L + N L cap)), and there layers stop early:
a placement with more than n stages has a bottleneck of at least min_{k < L} F_n[k, j] (its first n
stages are a state of layer n), of at least the best bottleneck over any number of stages, and of
at least a compute-only bound for that many stages (``_compute_bounds``), so once min over n' > n
of (M + n' - 1) times the largest of those bounds reaches the best T_step, no deeper layer can win;
likewise a state whose bottleneck times (M + n) reaches it is dropped.

Many assignments often share the bottleneck optimum; ``search.plan`` reruns the layered DP on its winner
with + in place of max and every time above the optimum's cycle masked out (``_refine``), to return
the equally fast assignment whose stage and hop times add up least.

Both programs are exact for the model in ``costs``/``evaluate``: every contiguous assignment is a
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


# Problems of at most this many (node, blocks) cells run the stage-count-layered DPs node by node
# with all stage counts at once; larger ones layer by layer with row loops and early stopping.
# Both are exact; the tests run both.
SMALL_LAYER_CELLS = 4096
# Above this many usable nodes the bottleneck DP first computes lower bounds to stop its layers early.
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
    num_blocks = model.num_blocks
    if caps[usable].sum() < num_blocks:
        return None
    comp = full_comp[usable]  # (K, L + 1), a copy
    comp[:, 0] = np.inf
    hop_index = np.append(usable, model.client)
    hop = model.hop[np.ix_(hop_index, hop_index)]  # (K + 1, K + 1), client last
    caps_u = caps[usable]
    if micro_batches == 1:
        found = _solve_sum(comp, hop, caps_u, num_blocks)
        if found is None:
            return None
        step_time, path = found
    else:
        found = _solve_bottleneck(comp, hop, caps_u, num_blocks, micro_batches)
        if found is None:
            return None
        step_time, path, cycle = found
        if refine:
            path = _refine(comp, hop, caps_u, num_blocks, cycle, len(path)) or path
    assignment = [0] * model.num_nodes
    for j, blocks in path:
        assignment[int(usable[j])] = blocks
    return Solution(batch_size, micro_batches, assignment, step_time, len(path))


def _best_length(arrive: np.ndarray, comp: np.ndarray, cap: int, k: int, op) -> int:
    """Backtracking: a stage length l (1..min(cap, k)) attaining min_l op(arrive[k - l], comp[l])."""
    longest = min(cap, k)
    values = op(arrive[k - longest : k][::-1], comp[1 : longest + 1])  # l = 1..longest
    return int(np.argmin(values)) + 1


def _solve_sum(comp: np.ndarray, hop: np.ndarray, caps: np.ndarray, num_blocks: int):
    """M = 1: minimise hop(client, first) + sum(comp + hop to next). Returns (T_step, [(j, l), ...])."""
    count = comp.shape[0]
    client = count
    size = num_blocks + 1
    width = int(caps.max())
    f = np.full((count, size), np.inf)
    arrive = np.full((count, size), np.inf)
    arrive[:, 0] = hop[client, :count]
    pad = np.full(width + size, np.inf)
    step = pad.strides[0]
    windows = as_strided(pad, shape=(width, size), strides=(step, step))  # [t, k] = arrive[k - (width - t)]
    reversed_comp = comp[:, width:0:-1, None]  # [j, t, 0]: l = width - t
    buffer = np.empty((width, size))
    into = np.empty((count, size))
    for j in range(count):
        a = arrive[j]
        if j:
            np.add(f[:j], hop[:j, j, None], out=into[:j])
            np.minimum(a, into[:j].min(axis=0), out=a)
        pad[width:] = a
        cap = int(caps[j])
        tmp = buffer[:cap]
        np.add(windows[width - cap :], reversed_comp[j, width - cap :], out=tmp)
        tmp.min(axis=0, out=f[j])
    totals = f[:, num_blocks] + hop[:count, client]
    last = int(np.argmin(totals))
    best = float(totals[last])
    if not math.isfinite(best):
        return None
    # walk back, recomputing each argmin with the same operations
    path = []
    j, k = last, num_blocks
    while True:
        l = _best_length(arrive[j], comp[j], int(caps[j]), k, np.add)
        path.append((j, l))
        k -= l
        if k == 0:  # f[., 0] is inf: the stage that starts at block 0 is entered from the client
            break
        j = int(np.argmin(f[:j, k] + hop[:j, j]))
    path.reverse()
    return best, path


def _solve_bottleneck(comp: np.ndarray, hop: np.ndarray, caps: np.ndarray, num_blocks: int, micro_batches: int):
    """M >= 2: minimise (M + n - 1) * max(all stage and hop times). Returns (T_step, [(j, l), ...], cycle)."""
    count = comp.shape[0]
    client = count
    size = num_blocks + 1
    if count * size <= SMALL_LAYER_CELLS:
        return _bottleneck_by_node(comp, hop, caps, num_blocks, micro_batches)
    nodes = np.arange(count)
    into = np.where(nodes[:, None] < nodes[None, :], hop[:count, :count], np.inf)  # into[p, j]: only p < j
    out = hop[:count, client]
    max_layers = min(count, num_blocks)
    # lower bounds on the bottleneck of any placement on n' stages, n' = 1..max_layers
    # (for a few nodes the layers are cheaper than the bounds: there they are left at 0)
    bounded = count > PRUNE_BOUNDS_MIN_NODES
    if bounded:
        lower = np.maximum(_compute_bounds(comp, num_blocks, max_layers), _global_bottleneck(comp, hop, caps, num_blocks))
    fill = micro_batches + np.arange(max_layers)  # M + n' - 1 for n' = 1..max_layers
    step = _LargeLayers(comp, caps, into, size)

    layers_f, layers_a = [], []
    best, best_n, best_j, best_cycle = math.inf, 0, -1, math.inf
    arrive = np.full((count, size), np.inf)
    arrive[:, 0] = hop[client, :count]
    for n in range(1, max_layers + 1):
        first = n - 1  # node n - 1 is the first that can be the n-th active stage
        if n > 1:
            arrive = step.arrive(layers_f[-1], first)
        f = step.stage(arrive, first)
        ends = np.maximum(f[:, num_blocks], out)
        j = int(np.argmin(ends))
        value = fill[n - 1] * ends[j]
        if value < best:
            best, best_n, best_j, best_cycle = value, n, j, float(ends[j])
        if n < max_layers and math.isfinite(best):
            # a state whose bottleneck so far, times M + n (at least n + 1 stages), reaches the best
            # cannot lead to a better plan; dropping it shrinks the row loops of the next layers
            f[:, num_blocks] = np.inf
            f[fill[n] * f >= best] = np.inf
        layers_f.append(f)
        layers_a.append(arrive)
        if n == max_layers:
            break
        # a placement on n' > n stages: its first n stages are a state of this layer with k < L
        partial = f[first:, :num_blocks].min()
        if not math.isfinite(partial):
            break
        if bounded:
            if np.min(fill[n:] * np.maximum(lower[n:], partial)) >= best:
                break
        elif fill[n] * partial >= best:
            break
    if not math.isfinite(best):
        return None
    path = []
    j, k = best_j, num_blocks
    for n in range(best_n, 0, -1):
        l = _best_length(layers_a[n - 1][j], comp[j], int(caps[j]), k, np.maximum)
        path.append((j, l))
        k -= l
        if n > 1:
            j = int(np.argmin(np.maximum(layers_f[n - 2][:, k], into[:, j])))
    path.reverse()
    return best, path, best_cycle


def _refine(comp: np.ndarray, hop: np.ndarray, caps: np.ndarray, num_blocks: int, cycle: float, max_stages: int):
    """Among the placements on at most ``max_stages`` stages whose every stage and hop time is at
    most ``cycle`` (all of them optimal for the bottleneck objective), the one with the smallest sum
    of times, i.e. the shortest trip of one micro-batch. Returns [(j, l), ...] or None."""
    count = comp.shape[0]
    client = count
    size = num_blocks + 1
    comp = np.where(comp <= cycle, comp, np.inf)
    hop = np.where(hop <= cycle, hop, np.inf)
    if count * size <= SMALL_LAYER_CELLS:
        found = _by_node(comp, hop, caps, num_blocks, np.add, max_stages)
        if found is None:
            return None
        states, arrivals = found
        totals = states[:, :, num_blocks] + hop[:count, client, None]  # [j, n - 1]
        j, n = np.unravel_index(int(np.argmin(totals)), totals.shape)
        if not math.isfinite(totals[j, n]):
            return None
        return _by_node_path(states, arrivals, comp, hop, caps, num_blocks, np.add, int(j), int(n))
    nodes = np.arange(count)
    into = np.where(nodes[:, None] < nodes[None, :], hop[:count, :count], np.inf)
    step = _LargeLayers(comp, caps, into, size, op=np.add)
    layers_f, layers_a = [], []
    best, best_n, best_j = math.inf, 0, -1
    arrive = np.full((count, size), np.inf)
    arrive[:, 0] = hop[client, :count]
    for n in range(1, min(max_stages, count, num_blocks) + 1):
        if n > 1:
            arrive = step.arrive(layers_f[-1], n - 1)
        f = step.stage(arrive, n - 1)
        totals = f[:, num_blocks] + hop[:count, client]
        j = int(np.argmin(totals))
        if totals[j] < best:
            best, best_n, best_j = float(totals[j]), n, j
        layers_f.append(f)
        layers_a.append(arrive)
    if not math.isfinite(best):
        return None
    path = []
    j, k = best_j, num_blocks
    for n in range(best_n, 0, -1):
        l = _best_length(layers_a[n - 1][j], comp[j], int(caps[j]), k, np.add)
        path.append((j, l))
        k -= l
        if n > 1:
            j = int(np.argmin(layers_f[n - 2][:, k] + into[:, j]))
    path.reverse()
    return path


def _by_node(comp: np.ndarray, hop: np.ndarray, caps: np.ndarray, num_blocks: int, op, max_stages: int):
    """The layered DP computed node by node, all stage counts at once (small K x L).

    states[j, n - 1, k] = best value (op = max: bottleneck, op = +: sum) of a placement of blocks
    [0, k) on exactly n active stages, the last one node j, its outgoing hop excluded;
    arrivals[j, n - 1, k] = the same just before node j's stage. Node j can only be the n-th stage
    for n <= j + 1, and each node's stage step is as wide as its own capacity. Returns
    (states, arrivals) or None when no stage count fits.
    """
    count = comp.shape[0]
    client = count
    size = num_blocks + 1
    depth = min(max_stages, count, num_blocks)
    if depth < 1:
        return None
    width = int(caps.max())
    states = np.full((count, depth, size), np.inf)
    arrivals = np.full((count, depth, size), np.inf)
    pad = np.full((depth, width + size), np.inf)
    stride = pad.strides
    # windows[t, n, k] = pad[n, k + t] = arrival[n, k - l] with l = width - t; l leads, so the min
    # over it runs over whole contiguous (n, k) planes
    windows = as_strided(pad, shape=(width, depth, size), strides=(stride[1], stride[0], stride[1]))
    buffer = np.empty((width, depth, size))
    hop_buffer = np.empty((count, depth, size))
    for j in range(count):
        top = min(j + 1, depth)  # node j is at most the (j + 1)-th stage
        arrival = arrivals[j]
        arrival[0, 0] = hop[client, j]
        if j and top > 1:
            tmp = hop_buffer[:j, : top - 1]
            op(states[:j, : top - 1], hop[:j, j, None, None], out=tmp)
            tmp.min(axis=0, out=arrival[1:top])
        cap = int(caps[j])
        pad[:top, width:] = arrival[:top]
        tmp = buffer[:cap, :top]
        op(windows[width - cap :, :top], comp[j, cap:0:-1, None, None], out=tmp)
        tmp.min(axis=0, out=states[j, :top])
    return states, arrivals


def _by_node_path(states, arrivals, comp, hop, caps, num_blocks: int, op, j: int, n: int) -> list[tuple[int, int]]:
    """Walk back from node j as the (n + 1)-th stage ending at block L."""
    path = []
    k = num_blocks
    while True:
        l = _best_length(arrivals[j, n], comp[j], int(caps[j]), k, op)
        path.append((j, l))
        k -= l
        if n == 0:
            break
        j = int(np.argmin(op(states[:j, n - 1, k], hop[:j, j])))
        n -= 1
    path.reverse()
    return path


def _bottleneck_by_node(comp: np.ndarray, hop: np.ndarray, caps: np.ndarray, num_blocks: int, micro_batches: int):
    """``_solve_bottleneck`` for small K x L: every stage count at once, node by node."""
    count = comp.shape[0]
    found = _by_node(comp, hop, caps, num_blocks, np.maximum, count)
    if found is None:
        return None
    states, arrivals = found
    ends = np.maximum(states[:, :, num_blocks], hop[:count, count, None])  # [j, n - 1]: the bottleneck
    cycles = ends.min(axis=0)
    values = (micro_batches + np.arange(cycles.size)) * cycles  # (M + n - 1) * C_n
    n = int(np.argmin(values))
    if not math.isfinite(values[n]):
        return None
    j = int(np.argmin(ends[:, n]))
    path = _by_node_path(states, arrivals, comp, hop, caps, num_blocks, np.maximum, j, n)
    return float(values[n]), path, float(cycles[n])


class _LargeLayers:
    """One layer of a layered DP as loops of row operations (large K x L): only p < j is touched
    in the hop step, and only nodes that can hold l blocks in the stage step. ``op`` combines a
    state with a stage or hop time: max for the bottleneck DP, + for the refinement's sum."""

    def __init__(self, comp: np.ndarray, caps: np.ndarray, into: np.ndarray, size: int, op=np.maximum):
        count = comp.shape[0]
        self.op = op
        self.size = size
        self.into = into
        self.order = np.argsort(-caps, kind="stable")  # stage step: rows by capacity, largest first
        self.comp_sorted = comp[self.order]
        self.holders = np.searchsorted(-caps[self.order], -np.arange(int(caps.max()) + 1), side="right")  # nodes with cap >= l
        self.buffer = np.empty((count, size))

    def arrive(self, prev: np.ndarray, first: int) -> np.ndarray:
        count = prev.shape[0]
        out = np.full(prev.shape, np.inf)
        finite = np.isfinite(prev)
        rows = np.flatnonzero(finite.any(axis=1))
        if rows.size == 0:
            return out
        size = prev.shape[1]
        starts = finite.argmax(axis=1)
        stops = size - finite[:, ::-1].argmax(axis=1)
        for p in rows:
            if p + 1 >= count:
                continue
            lo, hi = int(starts[p]), int(stops[p])
            tmp = self.buffer[: count - p - 1, : hi - lo]
            self.op(prev[p, None, lo:hi], self.into[p, p + 1 :, None], out=tmp)
            target = out[p + 1 :, lo:hi]
            np.minimum(target, tmp, out=target)
        return out

    def stage(self, arrive: np.ndarray, first: int) -> np.ndarray:
        size = self.size
        source = arrive[self.order]
        finite = np.isfinite(source)
        f = np.full(arrive.shape, np.inf)
        cols = np.flatnonzero(finite.any(axis=0))
        if cols.size == 0:
            return f
        c0, c1 = int(cols[0]), int(cols[-1]) + 1
        for l in range(1, len(self.holders)):
            rows = int(self.holders[l])
            stop = min(c1, size - l)
            if rows == 0 or stop <= c0:
                break
            tmp = self.buffer[:rows, : stop - c0]
            self.op(source[:rows, c0:stop], self.comp_sorted[:rows, l, None], out=tmp)
            target = f[:rows, c0 + l : stop + l]
            np.minimum(target, tmp, out=target)
        result = np.empty_like(f)
        result[self.order] = f
        return result


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


def _global_bottleneck(comp: np.ndarray, hop: np.ndarray, caps: np.ndarray, num_blocks: int) -> float:
    """The smallest possible max(stage and hop times) over any number of stages (a bound for pruning)."""
    count = comp.shape[0]
    client = count
    size = num_blocks + 1
    width = int(caps.max())
    f = np.full((count, size), np.inf)
    pad = np.full(width + size, np.inf)
    step = pad.strides[0]
    windows = as_strided(pad, shape=(width, size), strides=(step, step))
    reversed_comp = comp[:, width:0:-1, None]
    buffer = np.empty((width, size))
    into = np.empty((count, size))
    for j in range(count):
        a = np.full(size, np.inf)
        a[0] = hop[client, j]
        if j:
            np.maximum(f[:j], hop[:j, j, None], out=into[:j])
            np.minimum(a, into[:j].min(axis=0), out=a)
        pad[width:] = a
        cap = int(caps[j])
        tmp = buffer[:cap]
        np.maximum(windows[width - cap :], reversed_comp[j, width - cap :], out=tmp)
        tmp.min(axis=0, out=f[j])
    return float(np.maximum(f[:, num_blocks], hop[:count, client]).min())
