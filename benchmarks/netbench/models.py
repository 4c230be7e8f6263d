"""The models a sweep runs: bloombee-tiny, random Llamas (wide, pipeline, hop-bound), or any model folder / hub id / alias.

Random models are saved once (seeded) under benchmarks/results/tmp/netbench-models/ (ignored by
git) and reused while their spec is unchanged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = ROOT / "benchmarks" / "results" / "tmp" / "netbench-models"
SPEC_FILE = "netbench-model.json"


@dataclass(frozen=True)
class RandomLlama:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    seed: int = 0
    max_positions: int = 1024

    @property
    def folder_name(self) -> str:
        return f"random-llama-h{self.hidden}-l{self.layers}-i{self.intermediate}-v{self.vocab}"


# hidden 4096 at fp32 is 16 KB per token per hop, as much as LLaMA-30B's 6656 at fp16 (13 KB);
# intermediate 2 x hidden and 8 KV heads keep a block at ~142M parameters (CPU time down).
WIDE = RandomLlama(hidden=4096, layers=3, intermediate=8192, heads=32, kv_heads=8, vocab=512)
# the micro-batching workload: 6 blocks of ~50M parameters, 8 KB per token per hop at fp32, 16 heads without GQA
PIPELINE = RandomLlama(hidden=2048, layers=6, intermediate=5504, heads=16, kv_heads=16, vocab=1000)
# the paper's regime, where a hop costs far more than a block: 3 blocks of ~17M parameters, one per server, so a B=32
# decode step computes ~25 ms per server here against ~111 ms for its 256 KB at 20 Mbit/s
HOP_BOUND = RandomLlama(hidden=2048, layers=3, intermediate=512, heads=16, kv_heads=16, vocab=1000)
# bloombee-tiny's shape (scripts/train_tiny.py), for when the trained model is not there yet.
TINY_SHAPE = RandomLlama(hidden=256, layers=8, intermediate=688, heads=8, kv_heads=2, vocab=4096)


def make_random_llama(spec: RandomLlama, folder: Path | None = None) -> Path:
    """Save a seeded random LlamaForCausalLM of `spec` (fp32 safetensors), unless the same one is there."""
    folder = Path(folder or MODELS_DIR / spec.folder_name)
    marker = folder / SPEC_FILE
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec) and (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    logger.info("Creating random Llama %s in %s", spec, folder)
    config = LlamaConfig(hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
                         num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, vocab_size=spec.vocab,
                         max_position_embeddings=spec.max_positions, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(spec.seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    marker.write_text(json.dumps(asdict(spec)))
    return folder


def resolve(name: str) -> tuple[str, str, str]:
    """(model path or id passed to the CLIs, display name, note on what it is)."""
    lower = name.lower()
    if lower == "bloombee-tiny":
        from bloombee.loading import resolve_model

        try:
            path = resolve_model("bloombee-tiny")
            return str(path), "bloombee-tiny", "the trained default model"
        except (FileNotFoundError, OSError, ValueError) as error:  # not shipped: same shape, random weights
            logger.warning("bloombee-tiny is not available (%s); using a random Llama of its shape", error)
            return str(make_random_llama(TINY_SHAPE)), "bloombee-tiny-shape(random)", \
                "bloombee-tiny not available: a random Llama of its shape, NOT trained"
    if lower == "wide" or lower.startswith("wide:"):
        layers = int(lower.split(":", 1)[1]) if ":" in lower else WIDE.layers
        spec = RandomLlama(**{**asdict(WIDE), "layers": layers})
        return str(make_random_llama(spec)), f"wide-random-h{spec.hidden}-l{layers}", \
            f"random Llama, hidden {spec.hidden}, intermediate {spec.intermediate}, {spec.kv_heads} KV heads, vocab {spec.vocab}"
    if lower == "pipeline":
        return str(make_random_llama(PIPELINE)), "pipeline-random-h2048-l6", \
            "random Llama, hidden 2048, intermediate 5504, 16 heads (no GQA), vocab 1000, 6 blocks"
    if lower == "hop-bound":
        return str(make_random_llama(HOP_BOUND)), "hop-bound-random-h2048-i512-l3", \
            "random Llama, hidden 2048, intermediate 512, 16 heads, vocab 1000, 3 blocks (one per server): hops cost far " \
            "more than blocks"
    return name, Path(name).name or name, "as given"
