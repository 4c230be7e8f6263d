"""Write the paper's E1-E6 scenarios as planner input files (run from anywhere; rewrites e*.yaml here).

    python examples/plans/make_examples.py

LLaMA-30B (huggyllama/llama-30b: 60 blocks, hidden 6656, MLP 17920, 52 heads) on
- E1-E5: three RTX 5090 nodes; links of 45 Gbps (E1), 500, 250, 125 and 20 Mbps (E2-E5);
- E6: an A100 80GB in California and RTX 4090s in New Jersey and Canada, with the paper's Table 3
  bandwidth matrix.
Per-block cost tables come from examples/hardware.py's derive_cost_table (roofline from each
GPU's memory bandwidth and FLOPs, calibrated to the paper's measured ~35 ms for 20 LLaMA-30B blocks
on a 5090). See README.md for every assumption.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from transformers import LlamaConfig

from bloombee.planner.inputs import ModelSpec
from bloombee.planner.model_config import model_section_from_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for examples/

from examples.hardware import GPUS, derive_cost_table

HERE = Path(__file__).resolve().parent

# huggyllama/llama-30b's config.json, typed in (no network needed)
LLAMA_30B = LlamaConfig(
    num_hidden_layers=60,
    hidden_size=6656,
    intermediate_size=17920,
    num_attention_heads=52,
    num_key_value_heads=52,
    vocab_size=32000,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
)
WORKLOAD = {"batch_sizes": [8, 16, 32, 64, 128], "micro_batches": [1, 2, 4, 8], "seq_len": 128, "dtype": "float16"}
# the activation codec: BloomBee's byte-split zstd on LLaMA-30B activations, 416.4 KB -> 312.6 KB per hop
# (paper, section 8.5); encode 76.5 MiB in 300 ms (Table 1); decode 1 GB/s (bloombee.codec's prior)
CODEC = {"ratio": 1.332, "compress_mb_per_s": 267.0, "decompress_mb_per_s": 1000.0}
# usable GPU memory as nvidia-smi reports it, minus nothing: `reserved_gib` holds back 1.5 GiB
GPU_MEMORY_GIB = {"rtx5090": 31.8, "rtx4090": 23.99, "a100-80": 80.0}
HOST_MEMORY_GIB = {"rtx5090": 96.0, "rtx4090": 48.0, "a100-80": 200.0}

# E1: 45 Gbps in one data centre; the paper's measured NIC-to-NIC times there (4-8 ms for a few
# hundred KB, Tables 6-8) are per-message overhead, modelled as 2 ms of latency per machine.
# E2, E3: 500 Mbps / 25 ms and 250 Mbps / 50 ms between nodes (Fig. 12). E4, E5: 125 and 20 Mbps;
# their latencies (75 and 100 ms) are Table 6's NIC-to-NIC times minus the transfer time.
# A hop's latency is the sum of its two ends' access latencies, so each machine gets half.
ENVIRONMENTS = {
    "e1": ("E1: one data centre, 45 Gbps", 45000.0, 4.0),
    "e2": ("E2: 500 Mbps, 25 ms", 500.0, 25.0),
    "e3": ("E3: 250 Mbps, 50 ms", 250.0, 50.0),
    "e4": ("E4: 125 Mbps, 75 ms", 125.0, 75.0),
    "e5": ("E5: 20 Mbps, 100 ms", 20.0, 100.0),
}


def model_section() -> dict:
    section = model_section_from_config(LLAMA_30B, name="llama-30b")
    return section


def node(name: str, kind: str, model: ModelSpec, link: dict) -> dict:
    gpu = GPUS[kind]
    return {
        "name": name,
        "gpu": gpu.name,
        "gpu_memory_gib": GPU_MEMORY_GIB[kind],
        "host_memory_gib": HOST_MEMORY_GIB[kind],
        "reserved_gib": 1.5,
        "cost": derive_cost_table(gpu, model, reference_seq_len=128, num_attention_heads=52),
        "link": link,
        "compression": dict(CODEC),
    }


def homogeneous(key: str) -> dict:
    title, mbps, hop_latency = ENVIRONMENTS[key]
    model_raw = model_section()
    model = ModelSpec(**model_raw)
    link = {"uplink_mbps": mbps, "downlink_mbps": mbps, "latency_ms": hop_latency / 2}
    return {
        "model": model_raw,
        "workload": dict(WORKLOAD),
        "client": {"link": dict(link), "compression": dict(CODEC)},
        "nodes": [node(f"rtx5090-{i + 1}", "rtx5090", model, dict(link)) for i in range(3)],
    }


def e6() -> dict:
    model_raw = model_section()
    model = ModelSpec(**model_raw)
    access = {"uplink_mbps": 1000.0, "downlink_mbps": 1000.0, "latency_ms": 0.5}
    names = ["a100-california", "rtx4090-new-jersey", "rtx4090-canada", "client"]
    # Table 3 (Mbps, row = sender): CA->NJ 347, CA->CAN 305, NJ->CA 312, NJ->CAN 577, CAN->CA 280, CAN->NJ 643.
    # The client sits in California next to the A100: its hops to the others use California's row/column.
    bandwidth = [
        [None, 347.0, 305.0, None],
        [312.0, None, 577.0, 312.0],
        [280.0, 643.0, None, 280.0],
        [None, 347.0, 305.0, None],
    ]
    # one-way latencies (ms), from typical RTTs: CA-NJ 70, CA-Toronto 64, NJ-Toronto 20
    latency = [
        [None, 35.0, 32.0, 1.0],
        [35.0, None, 10.0, 35.0],
        [32.0, 10.0, None, 32.0],
        [1.0, 35.0, 32.0, None],
    ]
    return {
        "model": model_raw,
        "workload": dict(WORKLOAD),
        "client": {"link": dict(access), "compression": dict(CODEC)},
        "nodes": [
            node("a100-california", "a100-80", model, dict(access)),
            node("rtx4090-new-jersey", "rtx4090", model, dict(access)),
            node("rtx4090-canada", "rtx4090", model, dict(access)),
        ],
        "link_matrix": {"names": names, "bandwidth_mbps": bandwidth, "latency_ms": latency},
    }


HEADER = """# {title}
# LLaMA-30B, generated by examples/plans/make_examples.py (see README.md there for the assumptions).
# Plan it:  bloombee-plan --nodes examples/plans/{key}.yaml
"""


def main() -> None:
    scenarios = {key: (ENVIRONMENTS[key][0], homogeneous(key)) for key in ENVIRONMENTS}
    scenarios["e6"] = ("E6: A100 (California) + RTX 4090 (New Jersey) + RTX 4090 (Canada), Table 3 bandwidths", e6())
    for key, (title, data) in scenarios.items():
        text = HEADER.format(title=title, key=key) + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=110)
        (HERE / f"{key}.yaml").write_text(text)
        print(f"wrote {HERE / f'{key}.yaml'}")


if __name__ == "__main__":
    main()
