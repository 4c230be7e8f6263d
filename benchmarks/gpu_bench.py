"""A short GPU benchmark (scripts/gpu_check.sh runs it): a decode step of one block at each weight precision, and
with 0, half and all of its KV cache offloaded to host memory, in float16 on a random Llama block of LLaMA-7B's
shape (hidden 4096, MLP 11008, 32 heads). One table, and JSON under --out.

    python -m benchmarks.gpu_bench --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from bloombee.loading import load_block_stack
from bloombee.models.core.masks import causal_mask
from bloombee.models.core.quantize import module_weight_bytes
from bloombee.weight_formats import QUANT_TYPES

BATCHES = (1, 32)
OFFLOADS = (0.0, 0.5, 1.0)
CONTEXT = 512


def save_block(folder: Path) -> Path:
    """A one-block random Llama of LLaMA-7B's block shape, saved in float16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=1, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=256, max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(folder)
    return folder


def decode_ms(stack, batch: int, offload: float, repeats: int) -> float:
    """Median ms of a decode step of `batch` rows at slot CONTEXT of a cache (the same shapes every time, so each
    step runs the same kernels), after as many unrecorded steps (CUDA events around each step)."""
    caches = stack.new_caches(batch, CONTEXT + 1, offload=offload)
    hidden = torch.randn(batch, 1, stack.config.hidden_size, device="cuda", dtype=torch.float16)
    positions = torch.tensor([CONTEXT], device="cuda")
    mask = causal_mask(positions, CONTEXT + 1, batch_size=batch)
    times = []
    with torch.inference_mode():
        for _ in range(2 * repeats):
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            stack(hidden, positions.expand(batch, -1), caches, positions, mask)
            ended.record()
            ended.synchronize()
            times.append(began.elapsed_time(ended))
    return statistics.median(times[repeats:])


def measure(folder: Path, repeats: int) -> dict:
    """Every precision at each batch, then offload; the whole round twice, the first unrecorded (clocks, kernels)."""
    for _ in range(2):
        rows = measure_round(folder, repeats)
    return rows


def measure_round(folder: Path, repeats: int) -> dict:
    rows = {"quant": {}, "offload": {}}
    for quant in QUANT_TYPES:
        stack = load_block_stack(folder, 0, 1, dtype=torch.float16, device="cuda", quant_type=quant)
        rows["quant"][quant] = {"weight_mib": module_weight_bytes(stack) / 2**20,
                                **{f"B={b}": decode_ms(stack, b, 0.0, repeats) for b in BATCHES}}
        if quant == "none":
            rows["offload"] = {str(alpha): decode_ms(stack, BATCHES[-1], alpha, repeats) for alpha in OFFLOADS}
        del stack
        torch.cuda.empty_cache()
    return rows


def table(rows: dict) -> str:
    lines = [f"GPU: {torch.cuda.get_device_name()}; one LLaMA-7B-shaped block, float16, decode over {CONTEXT} tokens",
             f"{'precision':10} {'weights MiB':>12} " + " ".join(f"{f'ms B={b}':>10}" for b in BATCHES)]
    for quant, figures in rows["quant"].items():
        lines.append(f"{quant:10} {figures['weight_mib']:12.1f} " + " ".join(f"{figures[f'B={b}']:10.3f}" for b in BATCHES))
    lines.append(f"KV offload (none, B={BATCHES[-1]}): " + ", ".join(f"alpha {alpha}: {ms:.3f} ms"
                                                                   for alpha, ms in rows["offload"].items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for gpu_bench.json")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(save_block(Path(tmp)), args.repeats)
    print(table(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_bench.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), **rows}, indent=2))


if __name__ == "__main__":
    main()
