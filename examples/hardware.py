"""Example hardware: common GPUs and plausible per-block cost tables from their bandwidth and FLOPs.

For when no profile has been measured (examples/plans, the swarms of examples/swarms.py). One decoding step of one
block for a micro-batch of b sequences at context length s, roofline style:

    t_mlp(b)      = o_gpu + max(P * d / (eta_bw * BW),  2 * P * b / (eta_f * F))
    t_attn_gpu(b) = o_gpu + max(b * s * kv / (eta_bw * BW),  4 * b * s * q / (eta_f * F))
    t_attn_cpu(b) = o_cpu + b * s * kv / (eta_host * BW_host) + 2 * b * H * d / PCIe

P parameters per block (all weights stay on the GPU: projections, MLP, norms), d the dtype's bytes,
kv the KV bytes per token per block, q = n_heads x head_dim, H the hidden size. Decoding reads every
weight once per step, so t_mlp is bandwidth-bound until b is in the hundreds; attention reads the
micro-batch's KV cache, from GPU memory or (offloaded) from host memory by the CPU, which then
returns the attention output over PCIe.

The efficiencies are calibrated to the paper: eta_bw = 0.4 puts a LLaMA-30B block on an RTX 5090
at batch 32 at ~1.7 ms, in the paper's "1-3 ms per block on a desktop GPU" and close to its
measured ~35 ms for 20 blocks (Fig. 1, Tables 6-8); eta_f = 0.5; o_gpu = 0.05 ms of kernel launch
per part; CPU attention runs at half the host's DRAM bandwidth plus 0.2 ms of dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from bloombee.planner.inputs import DTYPE_BYTES, ModelSpec

ETA_BW = 0.4
ETA_FLOPS = 0.5
ETA_HOST = 0.5
GPU_OVERHEAD_MS = 0.05
CPU_OVERHEAD_MS = 0.2
TABLE_MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class GpuSpec:
    """A GPU and the machine it typically sits in (public datasheet figures)."""

    name: str
    memory_gib: float
    bandwidth_gb_s: float  # GPU memory bandwidth, 1e9 bytes/s
    fp16_tflops: float  # dense FP16 tensor throughput
    pcie_gb_s: float  # host <-> GPU, one direction
    host_memory_gib: float  # typical host RAM of such a machine
    host_bandwidth_gb_s: float  # its DRAM bandwidth


GPUS: dict[str, GpuSpec] = {
    "rtx3090": GpuSpec("RTX 3090", 24, 936, 71, 25, 64, 50),
    "rtx4090": GpuSpec("RTX 4090", 24, 1008, 165, 25, 64, 60),
    "rtx5090": GpuSpec("RTX 5090", 32, 1792, 209, 50, 128, 80),
    "l40s": GpuSpec("L40S", 48, 864, 362, 25, 256, 150),
    "a100-40": GpuSpec("A100 40GB", 40, 1555, 312, 25, 256, 150),
    "a100-80": GpuSpec("A100 80GB", 80, 1935, 312, 25, 256, 150),
    "h100": GpuSpec("H100 80GB", 80, 2000, 756, 50, 512, 250),
}


def derive_cost_table(
    gpu: GpuSpec,
    model: ModelSpec,
    dtype: str = "float16",
    reference_seq_len: int = 128,
    num_attention_heads: int | None = None,
    micro_batches: tuple[int, ...] = TABLE_MICRO_BATCHES,
) -> dict:
    """A ``cost:`` section (table form, attention at ``reference_seq_len``) for this GPU and model."""
    d = DTYPE_BYTES[dtype]
    weight = model.weight_bytes(dtype)
    params = weight / d
    kv = model.kv_bytes_per_token(dtype)
    hidden = model.hidden_size
    q_width = (num_attention_heads * model.head_dim) if (num_attention_heads and model.head_dim) else hidden
    bw = ETA_BW * gpu.bandwidth_gb_s * 1e9
    flops = ETA_FLOPS * gpu.fp16_tflops * 1e12
    host_bw = ETA_HOST * gpu.host_bandwidth_gb_s * 1e9
    pcie = gpu.pcie_gb_s * 1e9
    s = reference_seq_len
    mlp, attn_gpu, attn_cpu = [], [], []
    for b in micro_batches:
        mlp.append(GPU_OVERHEAD_MS + 1e3 * max(weight / bw, 2 * params * b / flops))
        attn_gpu.append(GPU_OVERHEAD_MS + 1e3 * max(b * s * kv / bw, 4 * b * s * q_width / flops))
        attn_cpu.append(CPU_OVERHEAD_MS + 1e3 * (b * s * kv / host_bw + 2 * b * hidden * d / pcie))
    return {
        "table": {
            "micro_batch": list(micro_batches),
            "mlp_ms": [round(v, 4) for v in mlp],
            "attn_gpu_ms": [round(v, 4) for v in attn_gpu],
            "attn_cpu_ms": [round(v, 4) for v in attn_cpu],
        },
        "reference_seq_len": reference_seq_len,
    }
