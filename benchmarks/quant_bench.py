"""Issue 30: what int8 and nf4 blocks cost in quality, save in bytes and take in time, against float32.

Quality on held-out text (bloombee/assets/eval/heldout_sample.txt): the whole model with every block quantised the
way a server quantises it (``bloombee.loading.local_model.LocalModel``) against the same model in float32, as the
top-1 agreement of their next-token predictions and the rise in cross-entropy (nats per token), for bloombee-tiny
(trained) and netbench's ``pipeline`` model (a random Llama of hidden 2048, 6 blocks of ~50M parameters). Bytes: the
hosted blocks' weights as stored, scales included, over their float32 bytes. Time: a decode step of one block at
batch 1 and 32 on this CPU, the median of several.

    .venv/bin/python -m benchmarks.quant_bench
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.netbench import models
from bloombee.loading import load_block_stack, resolve_model
from bloombee.loading.local_model import LocalModel
from bloombee.models.core.masks import causal_mask
from bloombee.models.core.quantize import module_weight_bytes
from bloombee.weight_formats import QUANT_TYPES

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "benchmarks" / "results" / "quant"
HELDOUT = ROOT / "bloombee" / "assets" / "eval" / "heldout_sample.txt"
FLOORS = {"int8": {"agreement": 0.98, "ce_rise": 0.02, "bytes": 0.30},
          "nf4": {"agreement": 0.90, "ce_rise": 0.05, "bytes": 0.16}}
DECODE_BATCHES = (1, 32)


def heldout_windows(model: str, vocab: int, length: int, count: int) -> torch.Tensor:
    """`count` windows of `length` tokens of the held-out text, in the model's tokenizer if it has one, else its
    bytes folded into the vocabulary (a random model has no tokenizer)."""
    text = HELDOUT.read_text()
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(resolve_model(model))(text).input_ids
    except (OSError, ValueError):
        ids = [byte % vocab for byte in text.encode()]
    step = max((len(ids) - length) // count, 1)
    return torch.tensor([ids[i * step:i * step + length] for i in range(count)])


def quality(reference: LocalModel, quantised: LocalModel, windows: torch.Tensor) -> dict:
    """Top-1 agreement with the reference and the cross-entropy of both on the windows' next tokens."""
    full, quant = reference.logits(windows).float(), quantised.logits(windows).float()
    targets = windows[:, 1:].reshape(-1)
    ce = {name: torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets).item()
          for name, logits in (("full", full), ("quant", quant))}
    agreement = (full.argmax(-1) == quant.argmax(-1)).float().mean().item()
    top1 = full.softmax(-1).max(-1).values.median().item()  # near 1/vocab: top-1 is a near-tie that any noise flips
    return {"agreement": agreement, "ce_full": ce["full"], "ce_quant": ce["quant"], "ce_rise": ce["quant"] - ce["full"],
            "full_top1_probability": top1}


def decode_ms(model: str, quant: str, batch: int, repeats: int) -> float:
    """Median milliseconds of a decode step (one token per row over a 32-token context) through one block."""
    stack = load_block_stack(model, 0, 1, dtype=torch.float32, quant_type=quant)
    hidden = torch.randn(batch, 1, stack.config.hidden_size, generator=torch.Generator().manual_seed(0))
    caches = stack.new_caches(batch, 64)
    times = []
    with torch.inference_mode():
        for step in range(32 + repeats):
            positions = torch.tensor([step])
            mask = causal_mask(positions, step + 1, batch_size=batch)
            began = time.perf_counter()
            stack(hidden, positions.expand(batch, -1), caches, positions, mask)
            if step >= 32:
                times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def floors_met(quant: str, figures: dict) -> dict[str, bool]:
    """Each floor of the issue for `quant`, met or not."""
    floors = FLOORS[quant]
    return {"agreement": figures["agreement"] >= floors["agreement"], "ce_rise": figures["ce_rise"] <= floors["ce_rise"],
            "bytes": figures["bytes_ratio"] <= floors["bytes"]}


def measure_model(name: str, windows: int, length: int, repeats: int) -> dict:
    path, label, note = models.resolve(name)
    reference = LocalModel(path, torch.float32, "none")
    vocab = reference.head.config.vocab_size
    tokens = heldout_windows(path, vocab, length, windows)
    full_bytes = module_weight_bytes(reference.stack)
    result = {"model": label, "note": note, "tokens": int(tokens.numel()), "quant": {}}
    for quant in QUANT_TYPES:
        quantised = reference if quant == "none" else LocalModel(path, torch.float32, quant)
        weight_bytes = module_weight_bytes(quantised.stack)
        figures = {"bytes": weight_bytes, "bytes_ratio": weight_bytes / full_bytes,
                   "decode_ms": {str(b): decode_ms(path, quant, b, repeats) for b in DECODE_BATCHES}}
        if quant != "none":
            figures.update(quality(reference, quantised, tokens))
            figures["floors_met"] = floors_met(quant, figures)
        result["quant"][quant] = figures
    return result


def markdown(results: list[dict], command: str) -> str:
    lines = ["# Quantised blocks: quality, bytes, decode time (issue 30)", "", f"Reproduce: `{command}`", "",
             f"CPU kernels: {torch.backends.cpu.get_cpu_capability()} (bitsandbytes' fast int8 and nf4 CPU paths need "
             "AVX-512; without it they dequantise and take 2-9x float32's time).", "",
             "| model | quant | top-1 agreement | float32's median top-1 p | CE full | CE quant | CE rise (nats) | "
             "bytes vs float32 | "
             + " | ".join(f"decode ms/block B={b}" for b in DECODE_BATCHES) + " | floors |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(DECODE_BATCHES) + "---|"]
    for result in results:
        for quant, f in result["quant"].items():
            quality_cells = ("-",) * 5 if quant == "none" else (
                f"{f['agreement']:.4f}", f"{f['full_top1_probability']:.3f}", f"{f['ce_full']:.4f}",
                f"{f['ce_quant']:.4f}", f"{f['ce_rise']:+.4f}")
            floors = "-" if quant == "none" else ("MET" if all(f["floors_met"].values()) else
                                                   "MISSED: " + ", ".join(k for k, ok in f["floors_met"].items() if not ok))
            lines.append(f"| {result['model']} | {quant} | " + " | ".join(quality_cells)
                         + f" | {f['bytes_ratio']:.3f} | " + " | ".join(f"{f['decode_ms'][str(b)]:.2f}" for b in DECODE_BATCHES)
                         + f" | {floors} |")
    lines += ["", "Floors: int8 agreement >= 0.98, CE rise <= 0.02 nats, bytes <= 0.30x; nf4 >= 0.90, <= 0.05, <= 0.16x."]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for offset, result in enumerate(results):
        quants = list(result["quant"])
        xs = [i + 0.4 * offset for i in range(len(quants))]
        axes[0].bar(xs, [result["quant"][q].get("agreement", 1.0) for q in quants], 0.4, label=result["model"])
        axes[1].bar(xs, [result["quant"][q]["bytes_ratio"] for q in quants], 0.4, label=result["model"])
        axes[2].bar(xs, [result["quant"][q]["decode_ms"][str(DECODE_BATCHES[-1])] for q in quants], 0.4,
                    label=result["model"])
    titles = ("top-1 agreement with float32", "weight bytes / float32", f"decode ms per block, B={DECODE_BATCHES[-1]}")
    for axis, title in zip(axes, titles):
        axis.set_xticks([i + 0.2 for i in range(len(QUANT_TYPES))], QUANT_TYPES)
        axis.set_title(title, fontsize=10)
    axes[0].set_ylim(0.0, 1.0)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quant_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bloombee-tiny,pipeline", help="netbench model names, comma-separated")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows per model")
    parser.add_argument("--length", type=int, default=96, help="tokens per window")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=20, help="timed decode steps per block and batch")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [measure_model(name, args.windows, args.length, args.repeats) for name in args.models.split(",")]
    command = "python -m benchmarks.quant_bench" + ("" if args.models == "bloombee-tiny,pipeline" else f" --models {args.models}")
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
               "torch_threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "results": results}
    (args.out / "quality.json").write_text(json.dumps(summary, indent=2))
    (args.out / "quality.md").write_text(markdown(results, command))
    plot(results, args.out / "quality.png")
    print(markdown(results, command))


if __name__ == "__main__":
    main()
