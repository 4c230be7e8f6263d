"""`bloombee-server --profile`: measure this server's per-block cost table, memory and codec for the planner.

The result is a planner node (`bloombee.planner.NodeSpec`): per-block decode times as functions of
the micro-batch size, split into what does not depend on the context (projections, MLP, norms:
the time of a step over a 1-token cache) and attention over a `seq_len`-token cache (the extra time
of the attention alone over that cache), once with the cache on the server's device and once with it
in host memory attended by the CPU. Each size is timed in several passes over all sizes and the median
counts, so that a busy moment of the machine spoils one pass, not the figure.
"""

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bloombee import codec
from bloombee.host import cpu_share, latency_ms
from bloombee.loading import load_block_stack, resolve_model
from bloombee.models.core.quantize import check_supported
from bloombee.models.core.timing import call_seconds
from bloombee.planner import NodeSpec
from bloombee.progress import progress
from bloombee.server.backend import BlockBackend
from bloombee.measure_cache import CACHE_DIR, cached
from bloombee.server.memory import CUDA_RESERVED, default_budgets
from bloombee.weight_formats import QuantType

logger = logging.getLogger(__name__)

GIB = 1024**3
MICRO_BATCHES = (1, 4, 16, 64, 256, 1024)
ROUNDS, REPEATS = 3, 2  # every size is timed REPEATS times in each of ROUNDS passes over all sizes; the median counts
PROFILE_VERSION = 8  # part of the cache key: figures measured by an older method are measured again


def _times_ms(run: Callable[[], object], device: torch.device) -> list[float]:
    """Milliseconds of each of REPEATS calls of `run` (device work included)."""
    return [1e3 * seconds for seconds in call_seconds(run, device, REPEATS)]


def _decode_ms(backend: BlockBackend, batch: int) -> list[float]:
    """Milliseconds of decode steps of one block over a 1-token cache: what does not depend on the context."""
    session = backend.new_session("profile", backend.start, backend.start + 1, batch, REPEATS + 2)
    token = torch.randn(batch, 1, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    backend.step(session, token, 0, 0, None, None)
    positions = iter(range(1, REPEATS + 2))
    return _times_ms(lambda: backend.step(session, token, next(positions), 0, None, None), backend.device)


def _attention_ms(backend: BlockBackend, batch: int, seq_len: int, offload: float) -> list[float]:
    """Milliseconds one block's attention of a decode step of `batch` rows takes over a `seq_len`-token cache more
    than over a 1-token one, with the fraction `offload` of its KV heads in host memory; timed on the attention
    alone, so that the block's much longer projections and MLP add no noise to it."""
    cfg, attention = backend.stack.block_configs[0], backend.stack.blocks[0].attn
    cache = backend.stack.new_caches(batch, seq_len, (backend.start, backend.start + 1), offload)[0]
    options = {"device": backend.device, "dtype": backend.dtype}
    heads, key_dim, value_dim = cfg.cache_layout
    q = torch.randn(batch, cfg.num_heads, 1, cfg.query_dim, **options)
    k, v = (torch.randn(batch, heads, 1, width, **options) for width in (key_dim, value_dim))

    def attend(length: int) -> list[float]:
        positions = torch.tensor([length - 1], device=backend.device)
        mask = torch.ones(batch, 1, length, dtype=torch.bool, device=backend.device)
        return _times_ms(lambda: cache.attend(q, k, v, positions, 0, mask, attention.attend), backend.device)

    return [max(long - short, 0.0) for long, short in zip(attend(seq_len), attend(1))]


def _cost_columns(backend: BlockBackend, seq_len: int, offload: float,
                  micro_batches: tuple[int, ...] = MICRO_BATCHES) -> tuple[list[float], list[float]]:
    """Per micro-batch size: (context-free ms, attention ms over seq_len tokens), each the median of its samples
    over every pass (robust to a busy moment, and the typical time rather than the luckiest)."""
    mlp: list[list[float]] = [[] for _ in micro_batches]
    attention: list[list[float]] = [[] for _ in micro_batches]
    sizes = [(round_, index) for round_ in range(ROUNDS) for index in range(len(micro_batches))]
    for _, index in progress(sizes, "profiling blocks", unit="size"):
        batch = micro_batches[index]
        mlp[index] += _decode_ms(backend, batch)
        attention[index] += _attention_ms(backend, batch, seq_len, offload)
    return [statistics.median(times) for times in mlp], [statistics.median(times) for times in attention]


def _prompt_outputs(backend: BlockBackend, batch: int, tokens: int) -> torch.Tensor:
    """One block's outputs of a prompt step: what the codec sees on the wire."""
    session = backend.new_session("profile", backend.start, backend.start + 1, batch, tokens)
    prompt = torch.randn(batch, tokens, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    return backend.step(session, prompt, 0, 0, None, None)


def _codec_figures(hidden: torch.Tensor) -> dict:
    """Ratio and speeds (raw MB/s, of the bytes beyond each call's own time) of the codec on this server's own block
    outputs, and that time per message."""
    began = time.perf_counter()
    frame = codec.encode(hidden, "auto")
    encoded = time.perf_counter()
    codec.decode(frame)
    decoded = time.perf_counter()
    raw, calls = hidden.numel() * hidden.element_size(), codec.call_costs()
    return {"ratio": raw / len(frame),
            "compress_mb_per_s": raw / 1e6 / max(encoded - began - calls.encode_s, 1e-9),
            "decompress_mb_per_s": raw / 1e6 / max(decoded - encoded - calls.decode_s, 1e-9),
            "call_ms": calls.both_s * 1e3}


def cached_profile(key: str, measure: Callable[[], dict], name: str, link_mbps: float, device: torch.device,
                   memory: tuple[int, int], quant_type: QuantType,
                   cache_path: Path = CACHE_DIR / "profiles.json") -> dict:
    """The planner node of this server: what `measure()` returns (measured once per `key`) as `planner_node`."""
    return planner_node(cached(cache_path, f"{key}|v{PROFILE_VERSION}", measure), name, link_mbps, device, memory,
                        quant_type)


def planner_node(measured: dict, name: str, link_mbps: float, device: torch.device, memory: tuple[int, int],
                 quant_type: QuantType | None = None) -> dict:
    """A planner node: `measure_profile`'s figures, named, with its link (and the latency its host measured), its
    (device, host) memory budgets in bytes, the precision its weights are fixed in (a server's; None: the planner
    chooses) and, on a CPU, the machine and cores its compute shares with other nodes there and what messages cost
    it."""
    node = {**measured, "name": name, **({"quant_type": quant_type} if quant_type else {}),
            "link": {"uplink_mbps": link_mbps, "downlink_mbps": link_mbps, "latency_ms": latency_ms()},
            "gpu_memory_gib": memory[0] / GIB, "host_memory_gib": memory[1] / GIB,
            "reserved_gib": CUDA_RESERVED / GIB if device.type == "cuda" else 0.0}
    if device.type == "cpu":
        node["cpu"] = cpu_share(torch.get_num_threads())
    NodeSpec.model_validate(node)
    return node


def measure_profile(backend: BlockBackend, seq_len: int = 32, micro_batches: tuple[int, ...] = MICRO_BATCHES) -> dict:
    """The planner node of this server but its memory and link, timed at `micro_batches` sizes: on a GPU, attention
    is timed twice, with the KV cache on the device and with all of it offloaded (in host memory, attended by the
    CPU)."""
    mlp, attention_device = _cost_columns(backend, seq_len, 0.0, micro_batches)
    attention_host = (attention_device if backend.device.type == "cpu"
                      else _cost_columns(backend, seq_len, 1.0, micro_batches)[1])
    sample = _prompt_outputs(backend, 16, seq_len)
    device_name = torch.cuda.get_device_name(backend.device) if backend.device.type == "cuda" else "cpu"
    node = {
        "gpu": f"{device_name} ({str(backend.dtype).removeprefix('torch.')})",
        "cost": {"table": {"micro_batch": list(micro_batches), "mlp_ms": mlp, "attn_gpu_ms": attention_device,
                           "attn_cpu_ms": attention_host}, "reference_seq_len": seq_len},
        "compression": _codec_figures(sample),
    }
    logger.info("Profile: %s", node["cost"]["table"])
    return node


def measure_node(model: str, name: str, device: str = "cpu", dtype: str = "auto", seq_len: int = 32,
                 micro_batches: tuple[int, ...] = MICRO_BATCHES, link_mbps: float = 100.0,
                 quant_types: tuple[QuantType, ...] = ("none",)) -> dict:
    """A planner node of this machine for `model` (what `bloombee-plan --measure` prints for a nodes.yaml), timed on
    the model's first block (every block of a model has the same shapes) in full precision and, as `quant_costs`, in
    each other of `quant_types`."""
    where = torch.device(device)
    measured = {quant: measure_profile(_first_block(model, where, dtype, quant), seq_len, tuple(micro_batches))
                for quant in dict.fromkeys(("none", *quant_types))}
    node = measured["none"]
    quant_costs = {quant: figures["cost"] for quant, figures in measured.items() if quant != "none"}
    if quant_costs:
        node = {**node, "quant_costs": quant_costs}
    return planner_node(node, name, link_mbps, where, default_budgets(where, "auto", "auto"))


def _first_block(model: str, device: torch.device, dtype: str, quant: QuantType) -> BlockBackend:
    """The backend of the model's first block on `device`, its weights in `quant`."""
    check_supported(quant, device)
    stack = load_block_stack(resolve_model(model), 0, 1, dtype=dtype if dtype == "auto" else getattr(torch, dtype),
                             device=device, quant_type=quant)
    return BlockBackend(stack, device, stack.dtype)
