"""`bloombee-server --profile`: measure this server's per-block cost table, memory and codec for the planner.

The result is a planner node (`bloombee.planner.NodeSpec`): per-block decode times as functions of
the micro-batch size, split into what does not depend on the context (projections, MLP, norms:
the time of a step over a 1-token cache) and attention over a `seq_len`-token cache (the extra time
of a step over that cache), once with the cache on the server's device and once with it in host
memory computed by the CPU.
"""

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bloombee import codec
from bloombee.host import cpu_share
from bloombee.planner import NodeSpec
from bloombee.progress import progress
from bloombee.server.backend import BlockBackend
from bloombee.server.measure_cache import CACHE_DIR, cached
from bloombee.server.memory import CUDA_RESERVED

logger = logging.getLogger(__name__)

GIB = 1024**3
MICRO_BATCHES = (1, 4, 16, 64, 256, 1024)
LONG_CACHE_ROWS = 64  # larger sizes are timed over a 1-token cache only (a long one would take minutes to fill)
PROFILE_VERSION = 5  # part of the cache key: figures measured by an older method are measured again


def _decode_ms(backend: BlockBackend, batch: int, context: int, repeats: int = 5,
               offload: float = 0.0) -> tuple[float, torch.Tensor]:
    """Milliseconds of one decode step of one block over a `context`-token cache (best of `repeats`), with the
    fraction `offload` of its KV cache in host memory."""
    session = backend.new_session("profile", backend.start, backend.start + 1, batch, context + repeats + 1, offload)
    prompt = torch.randn(batch, context, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    prefill = backend.step(session, prompt, 0, 0, None, None)
    best = float("inf")
    for repeat in range(repeats):
        began = time.perf_counter()
        backend.step(session, prompt[:, :1], context + repeat, 0, None, None)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        best = min(best, time.perf_counter() - began)
    return 1e3 * best, prefill


def _cost_columns(backend: BlockBackend, seq_len: int, offload: float = 0.0) -> tuple[list[float], list[float]]:
    """Per micro-batch size: (context-free ms, attention ms over seq_len tokens).

    Sizes above LONG_CACHE_ROWS (as many rows as a prompt step of a batch carries tokens) are timed
    without a long cache; their attention time extends the line of the sizes before."""
    mlp, attention = [], []
    for index, batch in enumerate(progress(MICRO_BATCHES, "profiling blocks", unit="size")):
        short, _ = _decode_ms(backend, batch, 1, offload=offload)
        mlp.append(short)
        if batch > LONG_CACHE_ROWS:
            before, last = MICRO_BATCHES[index - 2], MICRO_BATCHES[index - 1]
            slope = max(attention[-1] - attention[-2], 0.0) / (last - before)
            attention.append(attention[-1] + slope * (batch - last))
            continue
        full, _ = _decode_ms(backend, batch, seq_len, offload=offload)
        attention.append(max(full - short, 0.0))
    return mlp, attention


def _codec_figures(hidden: torch.Tensor) -> dict:
    """Ratio and speeds (raw MB/s) of the codec on this server's own block outputs."""
    began = time.perf_counter()
    frame = codec.encode(hidden, "auto")
    encoded = time.perf_counter()
    codec.decode(frame)
    decoded = time.perf_counter()
    raw = hidden.numel() * hidden.element_size()
    return {"ratio": raw / len(frame), "compress_mb_per_s": raw / 1e6 / max(encoded - began, 1e-9),
            "decompress_mb_per_s": raw / 1e6 / max(decoded - encoded, 1e-9)}


def cached_profile(key: str, measure: Callable[[], dict], name: str, link_mbps: float, device: torch.device,
                   memory: tuple[int, int], cache_path: Path = CACHE_DIR / "profiles.json") -> dict:
    """The planner node of this server: what `measure()` returns (measured once per `key`), named, with its link,
    its (device, host) memory budgets in bytes and, on a CPU, the machine and cores its compute shares with other
    servers there."""
    node = {**cached(cache_path, f"{key}|v{PROFILE_VERSION}", measure), "name": name,
            "link": {"uplink_mbps": link_mbps, "downlink_mbps": link_mbps, "latency_ms": 0.0},
            "gpu_memory_gib": memory[0] / GIB, "host_memory_gib": memory[1] / GIB,
            "reserved_gib": CUDA_RESERVED / GIB if device.type == "cuda" else 0.0}
    if device.type == "cpu":
        node["cpu"] = cpu_share(torch.get_num_threads())
    NodeSpec.model_validate(node)
    return node


def measure_profile(backend: BlockBackend, seq_len: int = 32) -> dict:
    """The planner node of this server but its memory and link: on a GPU, attention is timed twice, with the KV
    cache on the device and with all of it offloaded (in host memory, attended by the CPU)."""
    mlp, attention_device = _cost_columns(backend, seq_len)
    attention_host = attention_device if backend.device.type == "cpu" else _cost_columns(backend, seq_len, 1.0)[1]
    _, sample = _decode_ms(backend, 16, seq_len, repeats=1)  # a prompt step's outputs: what the codec sees
    device_name = torch.cuda.get_device_name(backend.device) if backend.device.type == "cuda" else "cpu"
    node = {
        "gpu": f"{device_name} ({str(backend.dtype).removeprefix('torch.')})",
        "cost": {"table": {"micro_batch": list(MICRO_BATCHES), "mlp_ms": mlp, "attn_gpu_ms": attention_device,
                           "attn_cpu_ms": attention_host}, "reference_seq_len": seq_len},
        "compression": _codec_figures(sample),
    }
    logger.info("Profile: %s", node["cost"]["table"])
    return node
