"""Seeded example swarms for the planner's benchmarks and tests (``swarm_inputs``).

A realistic swarm of consumer and datacenter GPUs on home and datacenter internet links, serving a
LLaMA-style model, with cost tables from ``examples.hardware.derive_cost_table``. Import it with the
repository root on ``sys.path``: ``from examples.swarms import swarm_inputs``.
"""

from __future__ import annotations

import numpy as np

from bloombee.planner.inputs import ModelSpec, PlanInputs
from examples.hardware import GPUS, derive_cost_table


def swarm_inputs(
    seed,
    num_nodes: int,
    num_blocks: int,
    batch_sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256),
    micro_batches: tuple[int, ...] = (1, 2, 4, 8),
    seq_len: int = 512,
) -> PlanInputs:
    """A swarm of `num_nodes` internet-connected GPU machines serving a LLaMA-style model of `num_blocks`
    blocks (hidden 8192, GQA with 8 KV heads, ~0.86 B parameters per block, like LLaMA-2-70B's)."""
    rng = np.random.default_rng(seed)
    model = ModelSpec(
        name=f"synthetic-{num_blocks}",
        num_blocks=num_blocks,
        hidden_size=8192,
        params_per_block=855_654_400,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=28672,
    )
    kinds = list(GPUS)
    weights = np.array([3, 4, 3, 1, 1, 1, 1], dtype=float)[: len(kinds)]
    nodes = []
    for i in range(num_nodes):
        gpu = GPUS[kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]]
        home = rng.random() < 0.7
        nodes.append(
            {
                "name": f"{gpu.name.lower().replace(' ', '-')}-{i}",
                "gpu": gpu.name,
                "gpu_memory_gib": gpu.memory_gib,
                "host_memory_gib": float(gpu.host_memory_gib * rng.uniform(0.3, 0.8)),
                "reserved_gib": 1.5,
                "cost": derive_cost_table(gpu, model, reference_seq_len=128, num_attention_heads=64),
                "link": {
                    "uplink_mbps": float(rng.uniform(20, 500) if home else rng.uniform(500, 10000)),
                    "downlink_mbps": float(rng.uniform(100, 1000) if home else rng.uniform(500, 10000)),
                    "latency_ms": float(rng.uniform(5, 40) if home else rng.uniform(1, 10)),
                },
                "compression": {"ratio": 1.33, "compress_mb_per_s": 267, "decompress_mb_per_s": 1000},
            }
        )
    return PlanInputs.model_validate(
        {
            "model": model.model_dump(exclude_none=True),
            "workload": {
                "batch_sizes": list(batch_sizes),
                "micro_batches": list(micro_batches),
                "seq_len": seq_len,
            },
            "client": {
                "link": {"uplink_mbps": 200.0, "downlink_mbps": 1000.0, "latency_ms": 10.0},
                "compression": {"ratio": 1.33, "compress_mb_per_s": 267, "decompress_mb_per_s": 1000},
            },
            "nodes": nodes,
        }
    )
