"""Seeded adversarial planning problems for the planner's tests (``random_inputs``).

Heterogeneous small problems: tight GPU memory (offloading and skipping matter), host memory that
sometimes binds, CPU attention sometimes faster than GPU attention, table and polynomial cost
models, asymmetric links, pairwise overrides (list and matrix), codecs on some machines and every
compression mode; weight precisions (allowed sets, nodes fixed in one, costs measured at some) drawn
from a generator of their own, so that the rest of each problem is what it was before precisions.
"""

from __future__ import annotations

import numpy as np

from bloombee.planner.chain import scaled_cost
from bloombee.planner.inputs import GIB, PlanInputs
from bloombee.weight_formats import QUANT_TYPES


def random_inputs(seed, num_nodes: int, num_blocks: int) -> PlanInputs:
    rng = np.random.default_rng(seed)
    weight = int(rng.uniform(0.2, 1.5) * GIB)
    kv_token = int(rng.integers(1, 64) * 1024)
    hidden = int(rng.choice([256, 1024, 4096, 8192]))
    model = {
        "name": "random",
        "num_blocks": num_blocks,
        "hidden_size": hidden,
        "weight_bytes_per_block": weight,
        "kv_bytes_per_token_per_block": kv_token,
        "workspace_bytes_per_token": int(rng.integers(0, 64) * 1024),
    }
    batch_sizes = sorted(set(int(b) for b in rng.choice([1, 2, 4, 8, 16, 32], size=int(rng.integers(1, 4)))))
    micro = sorted({1, *(int(m) for m in rng.choice([1, 2, 3, 4, 8], size=int(rng.integers(1, 3))))})
    seq_len = int(rng.choice([64, 256, 1024, 4096]))
    workload = {
        "batch_sizes": batch_sizes,
        "micro_batches": micro,
        "seq_len": seq_len,
        "dtype": str(rng.choice(["float16", "bfloat16", "float32"])),
        "compression": str(rng.choice(["auto", "auto", "on", "off"])),
    }
    kv_block_gib = max(batch_sizes) * seq_len * kv_token / GIB

    def link():
        return {
            "uplink_mbps": float(10 ** rng.uniform(1, 4)),
            "downlink_mbps": float(10 ** rng.uniform(1, 4)),
            "latency_ms": float(rng.uniform(0, 40)),
        }

    def codec():
        if rng.random() < 0.4:
            return None
        return {
            "ratio": float(rng.uniform(1.05, 2.0)),
            "compress_mb_per_s": float(10 ** rng.uniform(1.5, 3.5)),
            "decompress_mb_per_s": float(10 ** rng.uniform(2, 3.7)),
        }

    def cost():
        mlp = rng.uniform(0.1, 3.0)
        gpu = rng.uniform(0.01, 1.0)
        cpu = gpu * rng.uniform(0.5, 20.0)  # sometimes faster than the GPU
        if rng.random() < 0.5:
            sizes = sorted({int(x) for x in rng.choice([1, 2, 4, 8, 16, 32, 64], size=int(rng.integers(1, 4)))})
            grow = rng.uniform(0.0, 0.2)
            return {
                "table": {
                    "micro_batch": sizes,
                    "mlp_ms": [float(mlp * (1 + grow * s)) for s in sizes],
                    "attn_gpu_ms": [float(gpu * s) for s in sizes],
                    "attn_cpu_ms": [float(cpu * s) for s in sizes],
                },
                "reference_seq_len": int(rng.choice([64, 256, 1024])) if rng.random() < 0.5 else None,
            }
        return {
            "coefficients": {
                "mlp_ms": [float(mlp), float(rng.uniform(0, 0.05))],
                "attn_gpu_ms": [0.0, float(gpu)],
                "attn_cpu_ms": [float(rng.uniform(0, 0.5)), float(cpu)],
            }
        }

    nodes = []
    for i in range(num_nodes):
        reserved = float(rng.uniform(0, 0.5))
        blocks_on_gpu = rng.uniform(0, num_blocks + 1) if rng.random() < 0.9 else rng.uniform(0, 0.9)
        gpu_gib = reserved + 0.1 + blocks_on_gpu * (weight / GIB) + rng.uniform(0, 1.2) * kv_block_gib * blocks_on_gpu
        nodes.append(
            {
                "name": f"n{i}",
                "gpu_memory_gib": float(max(gpu_gib, 0.01)),
                "host_memory_gib": float(rng.choice([0.0, rng.uniform(0, 2) * kv_block_gib * num_blocks, 1e4])),
                "reserved_gib": reserved,
                "cost": cost(),
                "link": link(),
                "compression": codec(),
            }
        )
    names = [n["name"] for n in nodes] + ["client"]
    overrides = []
    for _ in range(int(rng.integers(0, 2 * len(names)))):
        src, dst = rng.choice(names, size=2, replace=False)
        overrides.append(
            {
                "src": str(src),
                "dst": str(dst),
                "bandwidth_mbps": float(10 ** rng.uniform(1, 4)) if rng.random() < 0.8 else None,
                "latency_ms": float(rng.uniform(0, 60)) if rng.random() < 0.5 else None,
            }
        )
    matrix = None
    if rng.random() < 0.4:
        size = len(names)
        matrix = {
            "names": names,
            "bandwidth_mbps": [
                [None if (i == j or rng.random() < 0.3) else float(10 ** rng.uniform(1, 4)) for j in range(size)]
                for i in range(size)
            ],
            "latency_ms": [
                [None if (i == j or rng.random() < 0.5) else float(rng.uniform(0, 60)) for j in range(size)]
                for i in range(size)
            ],
        }
    quantised(np.random.default_rng([seed, 1]), model, workload, nodes)
    return PlanInputs.model_validate(
        {
            "model": model,
            "workload": workload,
            "client": {"link": link(), "compression": codec()},
            "nodes": nodes,
            "link_overrides": overrides,
            "link_matrix": matrix,
        }
    )


def quantised(rng: np.random.Generator, model: dict, workload: dict, nodes: list[dict]) -> None:
    """Draw, in place, the model's nn.Linear share, the allowed precisions, nodes fixed in one and their costs at
    other precisions (slower or faster than their own)."""
    model["linear_params_per_block"] = int(model["weight_bytes_per_block"] / 4 * rng.uniform(0.5, 1.0))
    model["linear_rows_per_block"] = int(rng.integers(1, 1 << 16))
    allowed = [str(quant) for quant in QUANT_TYPES if rng.random() < 0.6] or ["nf4"]
    workload["quant"] = ["none"] if rng.random() < 0.3 else allowed
    for node in nodes:
        if rng.random() < 0.2:
            node["quant_type"] = str(rng.choice(QUANT_TYPES))
        node["quant_costs"] = {quant: scaled_cost(node, float(rng.uniform(0.5, 2.0)))["cost"]
                               for quant in QUANT_TYPES if rng.random() < 0.5}
