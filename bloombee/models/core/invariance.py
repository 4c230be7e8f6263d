"""Batch-invariant linear layers: a row's result does not depend on the rows one matmul computes with it.

BLAS libraries choose how to split a matmul (kernels, tiles, threads), and with it the order in which a dot product
adds up, by its number of rows. On one of this project's x86 CPUs (MKL and oneDNN, one or two threads) a float32
matmul of 1 row, of 2-3 rows and of 10 rows round a row differently, while matmuls of 4, 8, 16, ... 512 rows give a
row the same bits wherever it sits among them; on another, float32 matmuls of 1, of 2-8 and of 16-512 rows round
three ways, and bfloat16 ones alike from 1 to 32 rows but not above (bloombee-tiny's down projection rounds a few
values otherwise at 64 and 128 rows, and again alike at 256 and 512). So each process measures, for
the linear layers it computes with, a run of power-of-two row counts that all round a row alike (`row_range`), and
computes every matmul as chunks of such sizes (`chunk_linear_rows`): then a row comes out the same alone, in a
micro-batch, in a speculative tree or in a forward shared with other sessions' steps. Rows left over after the largest
chunks go as smaller chunks or as one chunk padded with zero rows, whichever the layers' times at each size, measured
with the range, say is faster: on this project's CPUs a float32 matmul of bloombee-tiny takes twice as long for 64
rows as for 16, one of hidden 2048 nearly twice as long, and a bfloat16 one as long. Where
no such run exists the mode cannot hold, and the caller says so. Two more things round a row by its company and are
fixed the same way: an activation's exp or tanh rounds differently in a vectorised loop's scalar tail than in its
body (so activations see rows padded to whole vector strides), and attention over a tree's 15 queries and its key
layout adds up differently than one query's (so in the mode a tree's nodes are attended one at a time). And a decode
step batched with longer ones attends keys padded further than alone: the mode probes that whole masked granules
leave a row's bits alone (`padding_invariant_attention`), else decode steps attend one session at a time.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bloombee.models.core.kv_cache import KVCache
from bloombee.models.core.masks import causal_mask
from bloombee.models.core.packing import Segment, granule_slots, pack
from bloombee.models.core.timing import call_seconds

logger = logging.getLogger(__name__)

MAX_CHUNK = 512  # rows of the largest matmul the probe tries
MIN_CEILING = 32  # rows of the largest chunk a run needs to be chosen over one of larger chunks (a 2048-token prompt
# then takes at most 64 matmuls a layer)
PROBED_LENGTHS = ((1, 64, 65, 200), (40, 41, 63, 130), (700, 3, 70, 1030))  # key slots of decode steps batched
LANES = 64  # elements: a multiple of any CPU vector loop's stride (AVX-512, unrolled twice: 32 float32 values)
CHUNK_SIZES = tuple(1 << power for power in range(MAX_CHUNK.bit_length()))  # 1, 2, 4, ... MAX_CHUNK


def _linear_kind(layer: nn.Linear) -> tuple:
    return type(layer), layer.in_features, layer.out_features, layer.bias is not None


def _distinct_linears(module: nn.Module) -> dict[nn.Linear, int]:
    """One linear layer of each kind and shape in `module`, and how many `module` holds of that kind."""
    linears = [layer for layer in module.modules() if isinstance(layer, nn.Linear)]
    counts, firsts = Counter(map(_linear_kind, linears)), {}
    for layer in linears:
        firsts.setdefault(_linear_kind(layer), layer)
    return {layer: counts[kind] for kind, layer in firsts.items()}


@dataclass(frozen=True)
class ChunkRange:
    """Power-of-two row counts from `floor` to `ceiling` whose matmuls give a row the same bits wherever it sits, and
    the seconds all the linear layers take at each of them (`seconds[i]`: `floor << i` rows), where they run."""

    floor: int
    ceiling: int
    seconds: tuple[float, ...]

    def cost(self, size: int) -> float:
        return self.seconds[size.bit_length() - self.floor.bit_length()]


def _size_output(layer: nn.Linear, inputs: torch.Tensor, size: int) -> torch.Tensor | None:
    """The output of all but the last row of `inputs` computed in matmuls of `size` rows; None where the last row
    comes out otherwise at the first, middle and last row of one such matmul. A kernel that adds a dot product up
    in another order changes a bfloat16 output only where its float32 sums straddle a rounding step, a few values
    in 100,000: hence every output of MAX_CHUNK rows, not one row's, tells two sizes apart."""
    rows, where = inputs[:size].clone(), sorted({0, size // 2, size - 1})
    rows[where] = inputs[-1]
    out = layer(rows)
    if not all(torch.equal(out[index], out[0]) for index in where):
        return None
    return torch.cat([layer(chunk) for chunk in inputs[:-1].split(size)])


def _alike_runs(outputs: list[torch.Tensor | None]) -> set[tuple[int, int]]:
    """(first, last) indices of every run of CHUNK_SIZES whose outputs are all equal."""
    runs = set()
    for first, reference in enumerate(outputs):
        last = first
        while (reference is not None and last < len(outputs) and outputs[last] is not None
               and torch.equal(outputs[last], reference)):
            runs.add((first, last))
            last += 1
    return runs


def choose_range(runs: set[tuple[int, int]]) -> tuple[int, int] | None:
    """Of runs of CHUNK_SIZES (first, last indices) that round alike, the (floor, ceiling) of the one with the smallest
    floor (a decode step pads least) among those whose ceiling reaches MIN_CEILING, else of the one with the largest
    ceiling."""
    if not runs:
        return None
    wide = [(first, last) for first, last in runs if CHUNK_SIZES[last] >= MIN_CEILING]
    first, last = (min(wide, key=lambda run: (run[0], -run[1])) if wide
                   else max(runs, key=lambda run: (run[1], -run[0])))
    return CHUNK_SIZES[first], CHUNK_SIZES[last]


@torch.inference_mode()
def row_range(module: nn.Module, dtype: torch.dtype, device: torch.device) -> ChunkRange | None:
    """The power-of-two row counts (up to MAX_CHUNK) that `module`'s linear layers compute a row alike among, with
    this process's threads (`choose_range` of the runs every layer rounds alike), and their seconds at each; None
    where no run does."""
    generator = torch.Generator().manual_seed(0)
    layers = _distinct_linears(module)
    common, inputs = None, {}
    for layer in layers:
        inputs[layer] = torch.randn(MAX_CHUNK + 1, layer.in_features, generator=generator).to(device, dtype)
        runs = _alike_runs([_size_output(layer, inputs[layer], size) for size in CHUNK_SIZES])
        common = runs if common is None else common & runs
    bounds = choose_range(common or set())
    if bounds is None:
        return None
    sizes = [size for size in CHUNK_SIZES if bounds[0] <= size <= bounds[1]]
    return ChunkRange(*bounds, tuple(sum(count * _matmul_seconds(layer, inputs[layer][:size])
                                         for layer, count in layers.items()) for size in sizes))


def _matmul_seconds(layer: nn.Linear, rows: torch.Tensor) -> float:
    """Seconds of `layer` on `rows` (a row count the probe has met, so set up): the faster of two calls."""
    return min(call_seconds(lambda: layer(rows), rows.device, 2))


@functools.lru_cache(maxsize=4096)
def chunk_sizes(rows: int, chunks: ChunkRange) -> tuple[int, ...]:
    """The matmul sizes `rows` rows are computed in: the range's ceiling while more are left, then the cheapest cover
    of the rest by the range's measured seconds (`_cheapest_cover`)."""
    full, rest = divmod(rows, chunks.ceiling)
    return (chunks.ceiling,) * full + (_cheapest_cover(rest, chunks)[1] if rest else ())


def _cheapest_cover(rows: int, chunks: ChunkRange) -> tuple[float, tuple[int, ...]]:
    """(seconds, sizes) of the faster of two ways to compute `rows` rows (fewer than the range's ceiling): one chunk
    padded to a power of two, at least the range's floor; or a chunk of the largest power of two that fits, then the
    cheapest cover of the rest."""
    padded = max(chunks.floor, 1 << (rows - 1).bit_length())
    pad = chunks.cost(padded), (padded,)
    fitting = 1 << (rows.bit_length() - 1)
    if fitting == rows or fitting < chunks.floor:
        return pad
    seconds, rest = _cheapest_cover(rows - fitting, chunks)
    split = chunks.cost(fitting) + seconds, (fitting, *rest)
    return split if split[0] < pad[0] else pad


def _chunked(forward, chunks: ChunkRange):
    def chunked_forward(x: torch.Tensor, *args) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        sizes = chunk_sizes(rows, chunks)
        if sizes == (rows,):
            return forward(x, *args)
        flat = x.reshape(rows, x.shape[-1])
        outputs, start = [], 0
        for size in sizes:
            chunk = flat[start:start + size]
            taken = chunk.shape[0]
            if taken < size:
                chunk = torch.cat([chunk, chunk.new_zeros(size - taken, chunk.shape[1])])
            outputs.append(forward(chunk, *args)[:taken])
            start += size
        out = torch.cat(outputs)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return chunked_forward


def _computes_by_rows(layer: nn.Module) -> bool:
    """A linear layer, or a module declaring ``row_wise``: its forward's output rows are matmuls of its first
    argument's rows alone (gpt-oss's packed experts, DeepSeek-V3's router), chunked as a linear layer is."""
    return isinstance(layer, nn.Linear) or getattr(layer, "row_wise", False)


def chunk_linear_rows(module: nn.Module, chunks: ChunkRange) -> None:
    """Make every linear layer (and row-wise module) of `module` compute its rows in the chunks `chunk_sizes`
    gives; a module with ``padded_rows_chunks`` (core.stack.BlockStack) pads a forward's rows once, at its start, to
    what those chunks hold, so that its layers need not pad each."""
    for layer in module.modules():
        if _computes_by_rows(layer):
            layer.forward = _chunked(layer.forward, chunks)
        if hasattr(layer, "padded_rows_chunks"):
            layer.padded_rows_chunks = chunks


def unchunk_linear_rows(module: nn.Module) -> None:
    """Undo `chunk_linear_rows`: each linear layer computes all its rows at once again."""
    for layer in module.modules():
        if _computes_by_rows(layer) and "forward" in vars(layer):
            del layer.forward
        if hasattr(layer, "padded_rows_chunks"):
            layer.padded_rows_chunks = None


def padded_rows(rows: int, chunks: ChunkRange) -> int:
    """The rows `chunk_sizes` computes `rows` rows as (the last chunk's padding included)."""
    return sum(chunk_sizes(rows, chunks))


class LaneAlignedActivation(nn.Module):
    """An elementwise activation computed on rows padded to whole SIMD strides, so that no row's last elements fall
    in a vectorised loop's scalar tail, where exp and tanh round differently than in its vector body."""

    def __init__(self, activation: nn.Module):
        super().__init__()
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (-x.shape[-1]) % LANES
        if not pad:
            return self.activation(x)
        return self.activation(F.pad(x, (0, pad)))[..., :x.shape[-1]]


def apply_batch_invariance(module: nn.Module, chunks: ChunkRange, trees: bool = True) -> None:
    """Make `module`'s blocks batch-invariant: linear layers in row chunks of `chunks`, activations on whole
    SIMD strides and, with `trees`, a speculative tree's nodes attended one at a time over exactly the keys a token
    decoded alone at its depth attends (`attend_tree_nodes`)."""
    chunk_linear_rows(module, chunks)
    for layer in list(module.modules()):
        if isinstance(getattr(layer, "act", None), nn.Module) and not isinstance(layer.act, LaneAlignedActivation):
            layer.act = LaneAlignedActivation(layer.act)
        if hasattr(layer, "tree_nodes_alone"):
            layer.tree_nodes_alone = trees


def make_batch_invariant(module: nn.Module, dtype: torch.dtype, device: torch.device, chunks: ChunkRange | None,
                         trees: bool = True) -> bool:
    """`apply_batch_invariance` in `module`'s chunk range (`row_range`); False where the mode cannot hold on this
    device (no range: logged)."""
    if chunks is None:
        logger.warning("Matmuls on %s (%s) round a row by the rows beside it at every size probed: rows computed "
                       "together may differ in their last bits from rows computed alone", device, dtype)
        return False
    apply_batch_invariance(module, chunks, trees)
    logger.info("Batch-invariant on %s (%s): matmuls in power-of-two chunks of %d to %d rows%s", device, dtype,
                chunks.floor, chunks.ceiling, ", tree nodes attended one at a time" if trees else "")
    if getattr(module, "batch_decode", False) and not padding_invariant_attention(module):
        module.batch_decode = False
        logger.info("Decode steps attend one session at a time: on %s (%s) attention over keys padded further "
                    "rounds a row differently", device, dtype)
    return True


@torch.inference_mode()
def padding_invariant_attention(stack: nn.Module) -> bool:
    """Whether each distinct attention of `stack`'s blocks (a core.stack.BlockStack) gives a one-token step the
    same bits alone as in a decode batch beside longer steps, whose keys it then reads padded further
    (`core.packing`), for the key lengths of PROBED_LENGTHS."""
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for block, cfg in zip(stack.blocks, stack.block_configs):
        kind = (type(block.attn), cfg.cache_layout, cfg.num_heads, cfg.sliding_window)
        if kind not in seen:
            seen.add(kind)
            if not all(_decodes_alike(block.attn, cfg, lengths, generator, stack.dtype, stack.device)
                       for lengths in PROBED_LENGTHS):
                return False
    return True


def _decodes_alike(attention: nn.Module, cfg, lengths: tuple[int, ...], generator: torch.Generator,
                   dtype: torch.dtype, device: torch.device) -> bool:
    """Whether one-token steps reading `lengths` key slots (over caches of random keys and values, masked slots
    included) come out of `attention.attend_decode` the same alone and together."""
    heads, key_dim, value_dim = cfg.cache_layout
    capacity = granule_slots(max(lengths))
    contents = [(torch.randn(1, heads, capacity, key_dim, generator=generator),
                 torch.randn(1, heads, capacity, value_dim, generator=generator)) for _ in lengths]
    q, k, v = attention.project(torch.randn(len(lengths), cfg.hidden_size, generator=generator).to(device, dtype))

    def attend(indices: list[int]) -> torch.Tensor:
        segments = []
        for index in indices:
            cache = KVCache(1, heads, capacity, key_dim, dtype, device, value_dim=value_dim)
            cache.k.copy_(contents[index][0])
            cache.v.copy_(contents[index][1])
            position = torch.tensor([lengths[index] - 1], device=device)
            segments.append(Segment(1, 1, position, causal_mask(position, lengths[index]), [cache]))
        rows = torch.tensor(indices, device=device)
        return attention.attend_decode(q[rows], k[rows], v[rows], pack(segments),
                                       [segment.caches[0] for segment in segments])

    together = attend(list(range(len(lengths))))
    return all(torch.equal(attend([index])[0], together[index]) for index in range(len(lengths)))
