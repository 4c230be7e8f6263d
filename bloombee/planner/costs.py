"""The model of one decoding step (the paper's equations 1-4), vectorised over nodes and block counts.

``StepModel(inputs, B, M)`` holds, for one candidate batch size B and micro-batch count M
(micro-batch size b = ceil(B / M)), everything the evaluator, the dynamic program, the brute force
and the baselines score with, so that all of them agree by construction:

- per node j and block count l: the weights' precision, the offload fraction alpha, the compute time
  T_comp, the GPU and host memory used, and whether it fits (``stage_arrays``);
- per ordered pair of machines (the client included): the time of one hop carrying one
  micro-batch's activations, and whether the codec is used on it (``hop``).

Memory (per node holding l blocks kept in precision q; bytes):

    weights   W  = l * weight_bytes_per_block(q)
    workspace WS = reserved + b * workspace_bytes_per_token
    KV        KV = l * B * s * kv_bytes_per_token_per_block      (the whole batch's cache, every M)
    alpha = max(0, 1 - (G - W - WS) / KV)                          (smallest offload that fits,
                                                                    rounded up to whole KV heads;
                                                                    a node's fixed `offload` instead)
    history   HS = B * s * (activation_bytes_per_token + 1)        (output history and token mask, in host memory)
    infeasible if W + WS > G ("GPU memory") or alpha * KV + HS > host  ("host memory")

Compute (seconds):  T_comp = l * (t_mlp(b) + (1 - alpha) * t_attn_gpu(b) + alpha * t_attn_cpu(b)), the times of
the node's cost at q (``quant_costs[q]``, else its ``cost``).

Precision: each of a node's candidate precisions (its fixed ``quant_type``, else ``workload.quant``) is
sized and timed as above; a stage (node, l) takes the one with the least T_comp among those that fit,
the most precise of equally fast ones (quantising that buys no time only costs accuracy). Where none
fits, the most compact one says why. Hops do not depend on it, and the step time grows with each
stage's T_comp, so choosing per stage is optimal.

A hop src -> dst carrying n = b * activation_bytes_per_token bytes:

    raw:        latency + n / bandwidth
    compressed: latency + n / (r * bandwidth) + n / C_src + n / D_dst + call_src
    compressed iff that is the faster (workload.compression = auto, by `rules.compression_pays`; call: one encode and
    one decode's own time),
    always where both ends have a codec (on), never (off); r and C from the sender, D from the receiver.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field

import numpy as np

from bloombee.weight_formats import QuantType

from .inputs import CLIENT, GIB, BlockCost, PlanInputs
from .rules import compression_pays

STATUS_OK = 0
STATUS_GPU = 1  # weights + workspace exceed GPU memory
STATUS_HOST = 2  # the offloaded share of the KV cache exceeds host memory
MS = 1e-3


def offload_fraction(free_bytes, kv_bytes, kv_heads: int | None = None):
    """The smallest fraction alpha of a KV cache of `kv_bytes` to keep in host memory so that the rest fits in
    `free_bytes` of device memory, rounded up to whole KV heads when `kv_heads` is known (servers split the cache
    by heads); numbers or numpy arrays. The one rule the planner, the servers' --offload auto and the clients share."""
    free, kv = np.asarray(free_bytes, dtype=np.float64), np.asarray(kv_bytes, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = np.where(kv > 0, np.clip(1.0 - free / kv, 0.0, 1.0), 0.0)
    if kv_heads:
        alpha = np.ceil(np.round(alpha * kv_heads, 9)) / kv_heads  # 2.0000000001 heads are 2
    return alpha


def micro_batch_size(batch_size: int, micro_batches: int) -> int:
    """The size of the largest micro-batch: it sets every stage's time (uneven splits round up)."""
    return -(-batch_size // micro_batches)


def block_times(cost: BlockCost, b: float, seq_len: int) -> tuple[float, float, float]:
    """(t_mlp, t_attn_gpu, t_attn_cpu) of one block at micro-batch size b, in seconds."""
    if cost.table is not None:
        table = cost.table
        values = _interp3(b, table.micro_batch, (table.mlp_ms, table.attn_gpu_ms, table.attn_cpu_ms))
    else:
        coeff = cost.coefficients
        values = [_poly(b, coeff.mlp_ms), _poly(b, coeff.attn_gpu_ms), _poly(b, coeff.attn_cpu_ms)]
    t_mlp, t_gpu, t_cpu = (max(0.0, v) * MS for v in values)
    if cost.reference_seq_len is not None:
        scale = seq_len / cost.reference_seq_len
        t_gpu *= scale
        t_cpu *= scale
    return t_mlp, t_gpu, t_cpu


def _interp3(b: float, x: list[float], ys: tuple[list[float], ...]) -> list[float]:
    """Piecewise-linear y(b) for several y over the same x: first value below x[0], the last
    segment extended above x[-1]."""
    if len(x) == 1 or b <= x[0]:
        return [y[0] for y in ys]
    i = bisect.bisect_right(x, b) - 1  # x[i] <= b
    if i >= len(x) - 1:  # at or past the last point: extend the last segment
        i = len(x) - 2
    share = (b - x[i]) / (x[i + 1] - x[i])
    return [y[i] + share * (y[i + 1] - y[i]) for y in ys]


def _poly(b: float, coefficients: list[float]) -> float:
    return float(sum(c * b**k for k, c in enumerate(coefficients)))


@dataclass(frozen=True)
class StageArrays:
    """Arrays over (nodes, block counts) as given to ``StepModel.stage_arrays``."""

    blocks: np.ndarray
    quant: np.ndarray  # index into StepModel.precisions
    weights: np.ndarray  # bytes
    alpha: np.ndarray
    comp: np.ndarray  # seconds; +inf where the stage does not fit
    gpu_used: np.ndarray  # bytes
    host_used: np.ndarray  # bytes
    status: np.ndarray  # STATUS_*
    without_offload: np.ndarray  # some candidate precision holds the blocks with alpha = 0


class StepModel:
    """The cost model of one decoding step for one candidate (B, M). See the module docstring."""

    def __init__(self, inputs: PlanInputs, batch_size: int, micro_batches: int):
        if batch_size < 1 or micro_batches < 1:
            raise ValueError("batch_size and micro_batches must be >= 1")
        self.inputs = inputs
        self.batch_size = int(batch_size)
        self.micro_batches = int(micro_batches)
        self.b = micro_batch_size(self.batch_size, self.micro_batches)
        workload, model = inputs.workload, inputs.model
        dtype = workload.dtype
        self.num_nodes = len(inputs.nodes)
        self.num_blocks = model.num_blocks
        self.seq_len = workload.seq_len
        static = _static(inputs)
        self.precisions: tuple[QuantType, ...] = static.precisions
        self.allowed = static.allowed
        self.weight_bytes = np.array([model.weight_bytes(dtype, quant) for quant in self.precisions])
        self.kv_bytes_token = model.kv_bytes_per_token(dtype)
        self.activation_bytes = model.activation_bytes(dtype)
        self.workspace_bytes_token = model.workspace_bytes(dtype)

        self.gpu_bytes = static.gpu_bytes
        self.host_bytes = static.host_bytes
        self.fixed_offload = static.fixed_offload
        self.workspace = static.reserved_bytes + self.b * self.workspace_bytes_token
        # what depends on b only is shared by every (B, M) with the same micro-batch size
        per_b = static.per_b.get(self.b)
        if per_b is None:
            times = np.array([[block_times(node.quant_cost(quant), self.b, self.seq_len) for node in inputs.nodes]
                              for quant in self.precisions]).reshape(len(self.precisions), self.num_nodes, 3)
            per_b = static.per_b[self.b] = (*(times[..., k].copy() for k in range(3)), self._hops(static))
        self.t_mlp, self.t_attn_gpu, self.t_attn_cpu, hops = per_b
        self.hop, self.hop_compressed, self.hop_wire_bytes = hops
        self.hop_bandwidth_mbps = static.bandwidth
        self.hop_latency_s = static.lat_s
        self.hop_raw_bytes = self.b * self.activation_bytes
        self.machine_names = static.names
        # KV bytes of one block for the whole batch at the full context length
        self.kv_block = self.batch_size * self.seq_len * self.kv_bytes_token
        self.history_bytes = self.batch_size * self.seq_len * (self.activation_bytes + 1)
        # the most compact candidate precision of each node: the one that says why nothing fits
        self.compact = np.argmin(np.where(self.allowed, self.weight_bytes[:, None], np.inf), axis=0)
        self._comp_table: tuple[np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------------------- stages

    def stage_arrays(self, blocks: np.ndarray) -> StageArrays:
        """Precision, alpha, T_comp, memory and status for node j holding blocks[j, ...] blocks.

        ``blocks`` has shape (N,) or (N, K); row j belongs to node j. Elementwise and deterministic:
        the same (node, l) gives bit-identical results whatever the shape.
        """
        blocks = np.asarray(blocks)
        scalar = blocks.ndim == 1
        l = blocks.astype(np.float64).reshape(self.num_nodes, -1)
        weights, kv, free, alpha, host_used, comp = self._per_precision(l)
        without_offload = (np.isfinite(comp) & (alpha == 0)).any(axis=0) | (l == 0)
        quant = self._choice(comp)
        weights, free, alpha, host_used, comp = (np.take_along_axis(a, quant[None], axis=0)[0]
                                                 for a in (weights, free, alpha, host_used, comp))
        col = (slice(None), None)
        gpu_used = weights + self.workspace[col] + (1.0 - alpha) * kv
        status = np.full(l.shape, STATUS_OK, dtype=np.int8)
        status[host_used > self.host_bytes[col]] = STATUS_HOST
        status[free < 0] = STATUS_GPU
        status[l == 0] = STATUS_OK
        alpha = np.where(l == 0, 0.0, alpha)
        out = StageArrays(blocks=l, quant=quant, weights=weights, alpha=alpha, comp=comp, gpu_used=gpu_used,
                          host_used=host_used, status=status, without_offload=without_offload)
        if scalar:
            out = StageArrays(**{k: v[:, 0] for k, v in out.__dict__.items()})
        return out

    def _per_precision(self, l: np.ndarray) -> tuple[np.ndarray, ...]:
        """(weights, kv, free GPU bytes, alpha, host bytes, T_comp) of node j holding l[j, ...] blocks in each
        precision (axis 0 where the figure depends on it); T_comp is inf where the blocks do not fit or the
        precision is not one of the node's, 0 for no blocks."""
        col, per_quant = (slice(None), None), (slice(None), slice(None), None)
        weights = l * self.weight_bytes[:, None, None]
        kv = l * self.kv_block
        free = self.gpu_bytes[col] - self.workspace[col] - weights
        needed = offload_fraction(free, kv, self.inputs.model.num_key_value_heads)
        alpha = np.where(np.isnan(self.fixed_offload[col]), needed, self.fixed_offload[col])
        host_used = self._host_used(l, alpha, kv)
        fits = (free >= 0) & ~(host_used > self.host_bytes[col]) | (l == 0)
        comp = np.where(fits & self.allowed[per_quant], l * self._per_block(alpha), np.inf)
        return weights, kv, free, alpha, host_used, comp

    def _choice(self, comp: np.ndarray) -> np.ndarray:
        """Per (node, l): the precision with the least T_comp (the first, most precise, of equals), the node's most
        compact one where none fits."""
        fastest = np.argmin(comp, axis=0)
        fits = np.isfinite(np.take_along_axis(comp, fastest[None], axis=0)[0])
        return np.where(fits, fastest, self.compact[:, None])

    def _host_used(self, l: np.ndarray, alpha: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """Host bytes of a node holding l blocks: the offloaded KV and, if it holds any, the sessions' output
        history and token mask (a server keeps both in host memory for failover)."""
        return alpha * kv + np.where(l > 0, self.history_bytes, 0.0)

    def _per_block(self, alpha: np.ndarray) -> np.ndarray:
        """T_comp of one block at offload fraction alpha (MLP on GPU, attention split GPU/CPU), per precision."""
        col = (slice(None), slice(None), None)
        return self.t_mlp[col] + (1.0 - alpha) * self.t_attn_gpu[col] + alpha * self.t_attn_cpu[col]

    def table(self) -> StageArrays:
        """``stage_arrays`` for every node and every block count 0..L: arrays of shape (N, L + 1)."""
        counts = np.broadcast_to(np.arange(self.num_blocks + 1), (self.num_nodes, self.num_blocks + 1))
        return self.stage_arrays(counts)

    def capacity(self, table: StageArrays | None = None, offload: bool = True) -> np.ndarray:
        """The most blocks each node can hold (feasibility is monotone in l); without offloading if asked."""
        table = table if table is not None else self.table()
        ok = (table.status == STATUS_OK) & (offload | table.without_offload)
        # ok is True for a prefix 0..cap of each row
        return np.argmin(np.concatenate([ok, np.zeros((self.num_nodes, 1), bool)], axis=1), axis=1) - 1

    def explain_capacity(self, node: int, blocks: int) -> str:
        """Why `node` cannot hold `blocks` blocks (or '' if it can)."""
        arrays = self.stage_arrays(np.array([blocks if j == node else 0 for j in range(self.num_nodes)]))
        status = int(arrays.status[node])
        spec = self.inputs.nodes[node]
        if status == STATUS_GPU:
            quant = self.precisions[int(arrays.quant[node])]
            kept = "" if quant == "none" else f"{quant} "
            return (
                f"GPU memory: {blocks} block{'' if blocks == 1 else 's'} of {kept}weights "
                f"({arrays.weights[node] / GIB:.2f} GiB) + workspace ({self.workspace[node] / GIB:.2f} GiB) exceed {spec.gpu_memory_gib:g} GiB"
            )
        if status == STATUS_HOST:
            kv = blocks * self.kv_block
            return (
                f"host memory: the KV cache that does not fit the GPU (alpha={arrays.alpha[node]:.2f} of "
                f"{kv / GIB:.2f} GiB) and the sessions' history ({self.history_bytes / GIB:.2f} GiB), "
                f"{arrays.host_used[node] / GIB:.2f} GiB in all, exceed {spec.host_memory_gib:g} GiB"
            )
        return ""

    # --------------------------------------------------------------------------------- hops

    def _hops(self, static: "_Static") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hop time, codec used, bytes on the wire) for every ordered pair of machines."""
        size = static.bandwidth.shape[0]
        n_bytes = self.b * self.activation_bytes
        rate, lat_s, r = static.rate, static.lat_s, static.ratio
        raw = lat_s + n_bytes / rate
        with np.errstate(invalid="ignore"):  # nan where an end has no codec; not used there
            compressed_time = (lat_s + n_bytes / (r * rate) + n_bytes / static.compress_speed
                               + n_bytes / static.decompress_speed + static.call_s)
            pays = compression_pays(rate, r, static.compress_speed, static.decompress_speed, static.call_s, n_bytes)
        mode = self.inputs.workload.compression
        if mode == "off":
            use = np.zeros((size, size), dtype=bool)
        elif mode == "on":
            use = static.both
        else:
            use = static.both & pays
        hop = np.where(use, compressed_time, raw)
        np.fill_diagonal(hop, np.inf)
        wire = n_bytes / np.where(use, r, 1.0)
        for array in (hop, use, wire):
            array.setflags(write=False)
        return hop, use, wire

    def comp_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(comp, caps) for the DP: comp[j, l] = T_comp of node j holding l = 0..L blocks in its best precision (inf
        where it does not fit), computed exactly as ``stage_arrays`` does; caps[j] = the most blocks j holds."""
        if self._comp_table is None:
            l = np.broadcast_to(np.arange(self.num_blocks + 1, dtype=np.float64), (self.num_nodes, self.num_blocks + 1))
            comp = self._per_precision(l)[-1].min(axis=0)
            fits = np.isfinite(comp)
            caps = np.argmin(np.concatenate([fits, np.zeros((self.num_nodes, 1), bool)], axis=1), axis=1) - 1
            self._comp_table = (comp, caps)
        return self._comp_table

    @property
    def client(self) -> int:
        """Index of the client in the hop matrices."""
        return self.num_nodes



@dataclass(frozen=True)
class _Static:
    """What does not depend on (B, M): node memory and the links between every pair of machines."""

    names: list[str]
    precisions: tuple[QuantType, ...]  # those some node may get, most precise first
    allowed: np.ndarray  # [precision, node]: one of the node's candidates
    gpu_bytes: np.ndarray
    host_bytes: np.ndarray
    reserved_bytes: np.ndarray
    fixed_offload: np.ndarray  # a node's fixed offload fraction, nan where the planner chooses it
    bandwidth: np.ndarray  # Mbps, [src, dst], client last
    latency: np.ndarray  # ms
    rate: np.ndarray  # bytes/s
    lat_s: np.ndarray
    ratio: np.ndarray  # [src, 1]
    compress_speed: np.ndarray  # [src, 1], bytes/s
    decompress_speed: np.ndarray  # [1, dst], bytes/s
    call_s: np.ndarray  # [src, 1], seconds of one encode and one decode beyond their bytes
    both: np.ndarray  # both ends have a codec
    per_b: dict = field(default_factory=dict)  # micro-batch size -> (t_mlp, t_attn_gpu, t_attn_cpu, hops)


# id(inputs) -> (weak reference, arrays); PlanInputs is frozen, so its derived arrays stay valid
_STATIC_CACHE: dict[int, tuple[weakref.ref, _Static]] = {}


def _static(inputs: PlanInputs) -> _Static:
    key = id(inputs)
    cached = _STATIC_CACHE.get(key)
    if cached is not None and cached[0]() is inputs:
        return cached[1]
    machines = [*inputs.nodes, inputs.client]
    names = [*inputs.node_names, CLIENT]
    index = {name: i for i, name in enumerate(names)}
    size = len(machines)
    up = np.array([m.link.uplink_mbps for m in machines])
    down = np.array([m.link.downlink_mbps for m in machines])
    lat = np.array([m.link.latency_ms for m in machines])
    bandwidth = np.minimum(up[:, None], down[None, :])
    latency = lat[:, None] + lat[None, :]
    if inputs.link_matrix is not None:  # the matrix first, then the list: the list wins
        matrix = inputs.link_matrix
        for a, src in enumerate(matrix.names):
            for c, dst in enumerate(matrix.names):
                if a == c:
                    continue
                i, j = index[src], index[dst]
                if matrix.bandwidth_mbps is not None and matrix.bandwidth_mbps[a][c] is not None:
                    bandwidth[i, j] = matrix.bandwidth_mbps[a][c]
                if matrix.latency_ms is not None and matrix.latency_ms[a][c] is not None:
                    latency[i, j] = matrix.latency_ms[a][c]
    for link in inputs.link_overrides:
        i, j = index[link.src], index[link.dst]
        if link.bandwidth_mbps is not None:
            bandwidth[i, j] = link.bandwidth_mbps
        if link.latency_ms is not None:
            latency[i, j] = link.latency_ms
    rate = bandwidth * 1e6 / 8.0
    codecs = [m.compression for m in machines]
    has = np.array([c is not None for c in codecs])
    ratio = np.array([c.ratio if c is not None else np.nan for c in codecs])[:, None]
    call_s = np.array([c.call_ms * MS if c is not None else np.nan for c in codecs])[:, None]
    c_speed = np.array([c.compress_mb_per_s * 1e6 if c is not None else np.nan for c in codecs])[:, None]
    d_speed = np.array([c.decompress_mb_per_s * 1e6 if c is not None else np.nan for c in codecs])[None, :]
    both = has[:, None] & has[None, :] & ~np.eye(size, dtype=bool)
    nodes = inputs.nodes
    precisions = inputs.quant_types_in_play
    static = _Static(
        names=names,
        precisions=precisions,
        allowed=np.array([[quant in choices for choices in inputs.quant_choices] for quant in precisions]),
        gpu_bytes=np.array([n.gpu_memory_gib * GIB for n in nodes]),
        host_bytes=np.array([n.host_memory_gib * GIB for n in nodes]),
        reserved_bytes=np.array([n.reserved_gib * GIB for n in nodes]),
        fixed_offload=np.array([np.nan if n.offload is None else n.offload for n in nodes]),
        bandwidth=bandwidth,
        latency=latency,
        rate=rate,
        lat_s=latency * MS,
        ratio=ratio,
        compress_speed=c_speed,
        decompress_speed=d_speed,
        call_s=call_s,
        both=both,
    )
    for array in (static.allowed, static.gpu_bytes, static.host_bytes, static.reserved_bytes, static.fixed_offload,
                  bandwidth, latency, rate, static.lat_s):
        array.setflags(write=False)
    _STATIC_CACHE[key] = (weakref.ref(inputs, lambda _, key=key: _STATIC_CACHE.pop(key, None)), static)
    return static
