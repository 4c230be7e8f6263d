#!/usr/bin/env python
"""Train BloomBee's embedded default model pair on the CPU, from the Python standard library.

Corpus: every ``*.py`` file of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), sorted, minus ``site-packages``, test suites
(``test``/``tests``/``idle_test`` folders), ``encodings`` (mostly generated codec tables) and
``pydoc_data`` (one generated help-text blob). Files are split into train/validation by a hash
of their relative path, so the split does not depend on which other files exist.

It trains, in order:

1. a byte-level BPE tokenizer (``tokenizers``; saved with ``PreTrainedTokenizerFast``), on the
   training files only;
2. ``bloombee-tiny``: a Llama model (8 blocks, hidden 256, 8 query heads / 2 KV heads);
3. ``bloombee-tiny-draft``: a 2-block, hidden-128 Llama draft for speculative decoding that
   shares the tokenizer.

It prints train/validation losses every ``--eval-every`` steps and the validation loss of an
add-one-smoothed bigram model fitted on the same tokenized training split (plus an
interpolated bigram as a stronger reference), saves both models as safetensors in
``--save-dtype`` with a model card (README.md) each, and writes two small fixtures the
test-suite uses (the training split's bigram counts and a held-out validation sample).

Everything is seeded: the same interpreter, library versions and arguments give the same run
(two runs of the draft gave bitwise-identical safetensors). The defaults are the shipped run:

    python scripts/train_tiny.py                 # both models into bloombee/assets (~50 min, 1 thread)
    python scripts/train_tiny.py --skip-draft    # only bloombee-tiny (what its card says it ran)
    python scripts/train_tiny.py --skip-target --skip-draft   # only the tokenizer and eval fixtures
    python scripts/train_tiny.py --out-dir /tmp/t --steps 20 --draft-steps 20   # smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shlex
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
EXCLUDED_TOP = {"site-packages", "encodings", "pydoc_data", "__phello__"}
EXCLUDED_ANY = {"test", "tests", "idle_test", "__pycache__"}


# ----------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(rel: str, val_percent: int) -> bool:
    digest = hashlib.sha1(rel.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < val_percent


def collect_corpus(val_percent: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(relative path, text) pairs for the train and validation split, each sorted by path."""
    root = stdlib_root()
    train, val = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in EXCLUDED_TOP or any(p in EXCLUDED_ANY for p in parts[:-1]):
            continue
        if parts[0].startswith("config-"):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        rel = "/".join(parts)
        (val if is_validation(rel, val_percent) else train).append((rel, text))
    return train, val


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        add_bos_token=True,
        add_eos_token=False,
        padding_side="left",
        **SPECIAL_TOKENS,
    )
    return fast


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one stream: <bos> doc <eos> <bos> doc <eos> ..."""
    raw = tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else tokenizer
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out: list[int] = []
    for enc in raw.encode_batch(texts, add_special_tokens=False):
        out.append(bos)
        out.extend(enc.ids)
        out.append(eos)
    return torch.tensor(out, dtype=torch.long)


# ----------------------------------------------------------------------------------------------
# bigram baselines
# ----------------------------------------------------------------------------------------------
def bigram_counts(stream: np.ndarray, vocab: int) -> np.ndarray:
    pairs = stream[:-1].astype(np.int64) * vocab + stream[1:].astype(np.int64)
    return np.bincount(pairs, minlength=vocab * vocab).reshape(vocab, vocab)


def bigram_addk_loss(counts: np.ndarray, targets_prev: np.ndarray, targets_next: np.ndarray, k: float = 1.0) -> float:
    """Mean NLL (nats) of p(b|a) = (c(a,b)+k) / (c(a)+kV) over the given (a, b) pairs."""
    vocab = counts.shape[0]
    row = counts.sum(1)
    num = counts[targets_prev, targets_next] + k
    den = row[targets_prev] + k * vocab
    return float(-np.mean(np.log(num / den)))


def bigram_interp_loss(counts: np.ndarray, prev: np.ndarray, nxt: np.ndarray, lam: float) -> float:
    """lam * ML bigram + (1-lam) * add-one unigram."""
    vocab = counts.shape[0]
    row = counts.sum(1)
    uni = (counts.sum(0) + 1.0) / (counts.sum() + vocab)
    ml = np.where(row[prev] > 0, counts[prev, nxt] / np.maximum(row[prev], 1), 0.0)
    p = lam * ml + (1 - lam) * uni[nxt]
    return float(-np.mean(np.log(p)))


# ----------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------
def make_config(kind: str, tokenizer, args):
    from transformers import LlamaConfig

    common = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    if kind == "target":
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=args.target_blocks,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, **common)
    else:
        cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, **common)
    return cfg


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def val_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Windows of seq_len+1 tokens overlapping by one, so every token but the first is a target."""
    n = (len(stream) - 1) // seq_len
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


@torch.no_grad()
def eval_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size]
        logits = model(input_ids=w[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor * peak + (1 - floor) * peak * 0.5 * (1 + math.cos(math.pi * progress))


def train_model(name, cfg, train_stream, val_stream, args, steps, batch_size, lr, residual_init):
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    if residual_init == "zero":
        # Every block starts as the identity on the residual stream (the net starts as a bigram
        # model, embeddings -> norm -> head); with HF's N(0, 0.02) there, 8 random blocks drown
        # the 0.02-scale token embeddings and the deep model sits at the unigram loss for longer.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                    p.zero_()
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed + 1)
    all_val = val_windows(val_stream, args.seq_len)
    probe = all_val[torch.randperm(len(all_val), generator=torch.Generator().manual_seed(args.seed + 2))[: args.eval_windows]]
    warmup = max(1, int(args.warmup_frac * steps))
    seq = args.seq_len
    print(f"[{name}] params={n_params(model):,} steps={steps} batch={batch_size}x{seq} lr={lr} warmup={warmup}", flush=True)
    history = []
    t0 = time.time()
    running = None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup, args.min_lr_frac)
        starts = torch.randint(0, len(train_stream) - seq - 1, (batch_size,), generator=gen)
        batch = train_stream[starts[:, None] + torch.arange(seq + 1)[None, :]]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % args.eval_every == 0 or step + 1 == steps or step == 0:
            elapsed = time.time() - t0
            vl = eval_loss(model, probe, args.eval_batch)
            history.append((step + 1, running, vl))
            print(f"[{name}] step {step + 1:5d}/{steps} train {running:.4f} val(probe) {vl:.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {elapsed:7.1f}s {(step + 1) / elapsed:.3f} steps/s", flush=True)
    train_time = time.time() - t0
    print(f"[{name}] trained in {train_time:.1f}s", flush=True)
    return model, dict(train_time=train_time, probe=probe, probe_fp32=history[-1][2], history=history, steps=steps,
                       batch_size=batch_size, lr=lr, warmup=warmup, tokens_seen=steps * batch_size * seq)


# ----------------------------------------------------------------------------------------------
# saving
# ----------------------------------------------------------------------------------------------
def save_model(model, tokenizer, folder: Path, save_dtype: torch.dtype):
    from transformers import GenerationConfig

    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file():
            f.unlink()
    model = model.to(save_dtype)
    model.config.dtype = save_dtype
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=64,
    )
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    model.to(torch.float32)
    # Keys older transformers releases (4.x, which pyproject allows) read; 5.x accepts them too.
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = str(save_dtype).removeprefix("torch.")
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(tok_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


def reload_val_loss(folder: Path, windows: torch.Tensor, probe: torch.Tensor, batch: int) -> tuple[float, float]:
    """(whole validation split, probe windows) losses of the stored weights, run in fp32."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return eval_loss(m, windows, batch), eval_loss(m, probe, batch)


def sample_generation(folder: Path, prompt: str, max_new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = m.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0], skip_special_tokens=True)


def human_time(s: float) -> str:
    return f"{int(s // 60)} min {s % 60:.0f} s"


def write_card(folder: Path, name: str, role: str, cfg, info: dict, corpus: dict, baselines: dict,
               command: str, sample: str, save_dtype: str, threads: int):
    hist = "\n".join(f"| {s} | {tr:.3f} | {vl:.3f} |" for s, tr, vl in info["history"])
    text = f"""---
license: mit
library_name: transformers
pipeline_tag: text-generation
tags: [llama, tiny, bloombee]
---

# {name}

{role}

Trained from scratch on a CPU by `scripts/train_tiny.py`; BloomBee ships it as package data
(`bloombee/assets/{name}`). It is small on purpose: demos, tests and benchmarks run it on laptops.
It writes plausible-looking Python and nothing else; it is not useful as an assistant.

## Architecture

| | |
|---|---|
| architecture | `LlamaForCausalLM` |
| blocks | {cfg.num_hidden_layers} |
| hidden size | {cfg.hidden_size} |
| MLP size | {cfg.intermediate_size} (SwiGLU) |
| attention heads / KV heads | {cfg.num_attention_heads} / {cfg.num_key_value_heads} (head dim {cfg.head_dim}) |
| vocabulary | {cfg.vocab_size} (byte-level BPE, shared by `bloombee-tiny` and `bloombee-tiny-draft`) |
| tied embeddings | {cfg.tie_word_embeddings} |
| parameters | {info['params']:,} |
| stored dtype | {save_dtype} (load with `dtype=torch.float32` for exact CPU math) |
| trained context | {info['seq_len']} tokens (`max_position_embeddings` = {cfg.max_position_embeddings}; quality beyond {info['seq_len']} is untested) |

## Training data

The `.py` files of the Python {corpus['python']} standard library (`sysconfig.get_paths()["stdlib"]`),
sorted, without `site-packages`, test suites (`test/`, `tests/`, `idle_test/`), `encodings/`
(generated codec tables) and `pydoc_data/`. Split by file (SHA-1 of the relative path,
{corpus['val_percent']}% to validation):

| split | files | bytes | tokens |
|---|---|---|---|
| train | {corpus['train_files']} | {corpus['train_bytes']:,} | {corpus['train_tokens']:,} |
| validation | {corpus['val_files']} | {corpus['val_bytes']:,} | {corpus['val_tokens']:,} |

Each file is one document, `<|bos|> text <|eos|>`, concatenated; training samples random
windows of {info['seq_len']}+1 tokens.

## Training

Initialisation: transformers' Llama default (N(0, 0.02)){info['init_note']}.
AdamW (betas 0.9/0.95, weight decay {info['weight_decay']} on matrices), peak LR {info['lr']},
{info['warmup']} warm-up steps then cosine decay to {info['min_lr_frac']:g}× peak, gradient clipping 1.0,
fp32, batch {info['batch_size']} × {info['seq_len']} tokens, {info['steps']} steps
({info['tokens_seen']:,} tokens, {info['tokens_seen'] / max(1, corpus['train_tokens']):.2f} epochs),
seed {info['seed']}, {threads} CPU thread(s) ({corpus['cpu']}).

Training time: **{human_time(info['train_time'])}** (wall clock, excluding tokenizer training and
evaluation).

| step | train loss (EMA) | validation loss (probe, {info['eval_windows']} windows) |
|---|---|---|
{hist}

## Evaluation

Mean next-token cross-entropy (nats/token) on the whole validation split
({corpus['val_targets']:,} target tokens: the split cut into windows of {info['seq_len']}+1 tokens
that overlap by one, so every token but the first is predicted, with its full window as
context); the bigram baselines are fitted on the tokenized training split and scored on exactly
the same target tokens.

| model | validation loss | perplexity |
|---|---|---|
| **{name}** (weights as stored, {save_dtype}, run in fp32) | **{info['val_loss_saved']:.4f}** | {math.exp(info['val_loss_saved']):.1f} |
| {name} on the {info['eval_windows']}-window probe: fp32 weights → stored {save_dtype} weights | {info['probe_fp32']:.4f} → {info['probe_saved']:.4f} | |
| bigram, add-one smoothing | {baselines['addone']:.4f} | {math.exp(baselines['addone']):.1f} |
| bigram, interpolated with unigram (λ={baselines['lam']}, best λ on validation) | {baselines['interp']:.4f} | {math.exp(baselines['interp']):.1f} |
| uniform over the vocabulary | {math.log(cfg.vocab_size):.4f} | {cfg.vocab_size} |

## Sample

Greedy decoding (`do_sample=False`), prompt `def fibonacci(n):`, 64 new tokens:

```python
{sample}
```

## Reproduce

```bash
{command}
```

Each model is seeded on its own (`torch.manual_seed`, a seeded data sampler, one thread), so
`--skip-draft` / `--skip-target` runs and a run that trains both give the same weights. The
corpus depends on the interpreter's standard library, so another Python version gives a
different (equally valid) model.
"""
    (folder / "README.md").write_text(text, encoding="utf-8")


def vocab_digest(tokenizer) -> str:
    """SHA-256 of the sorted (token, id) pairs: ties the bigram fixture to one tokenizer."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def write_fixtures(out: Path, val, counts: np.ndarray, tokenizer, val_bytes: int):
    """Test fixtures: a held-out text sample and the training split's bigram counts.

    ``heldout_sample.txt``: whole files of the validation split in sorted order (every 3rd),
    the last one cut at a line break. ``bigram_counts.npz``: the non-zero bigram counts of the
    tokenized training split, pairs as a*V+b, delta-encoded (``np.cumsum(pair_deltas)``).
    """
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("train_sample.txt",):
        (out / stale).unlink(missing_ok=True)
    chunks, size = [], 0
    for rel, text in val[::3]:
        if size >= val_bytes:
            break
        piece = text[: val_bytes - size]
        if len(piece) < len(text):
            piece = piece[: piece.rfind("\n") + 1]
        chunks.append(f"# ---- {rel}\n{piece}")
        size += len(chunks[-1].encode("utf-8"))
    (out / "heldout_sample.txt").write_text("".join(chunks), encoding="utf-8")
    flat = counts.reshape(-1)
    pairs = np.flatnonzero(flat)
    np.savez_compressed(
        out / "bigram_counts.npz",
        pair_deltas=np.diff(pairs, prepend=0).astype(np.int32),
        counts=flat[pairs].astype(np.int32),
        vocab_size=np.int64(counts.shape[0]),
        vocab_sha256=np.array(vocab_digest(tokenizer)),
    )
    (out / "README.md").write_text(
        "# Evaluation fixtures for the tiny models\n\n"
        "Written by every run of `scripts/train_tiny.py` (`--skip-target --skip-draft` writes only these), "
        "from the Python standard library (PSF license):\n\n"
        f"- `heldout_sample.txt`: ~{val_bytes // 1000} kB of the *validation* split (every 3rd file, sorted by "
        "path); neither the tokenizer nor the models saw it.\n"
        f"- `bigram_counts.npz`: the {len(pairs):,} non-zero bigram counts of the tokenized *training* split "
        f"({int(flat.sum()):,} pairs; key a*V+b, delta-encoded as `pair_deltas`, plus `counts`, `vocab_size` and "
        "`vocab_sha256`, a digest of the tokenizer's vocabulary). `tests/test_tiny_model.py` rebuilds the "
        "models' bigram baselines from it.\n",
        encoding="utf-8",
    )


# ----------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="bloombee/assets", help="folder that receives bloombee-tiny, bloombee-tiny-draft, eval/")
    p.add_argument("--steps", type=int, default=800, help="target model optimizer steps")
    p.add_argument("--draft-steps", type=int, default=600, help="draft model optimizer steps")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="target batch (sequences per step)")
    p.add_argument("--draft-batch-size", type=int, default=None, help="draft batch (default: --batch-size)")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--val-percent", type=int, default=5)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=32, help="validation windows in the periodic probe")
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--residual-init", choices=["zero", "hf"], default="zero",
                   help="target's o_proj/down_proj init: zero (blocks start as the identity) or transformers' default")
    p.add_argument("--draft-residual-init", choices=["zero", "hf"], default="hf",
                   help="the same for the draft (2 blocks learn fast from the default init)")
    p.add_argument("--save-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--skip-draft", action="store_true")
    p.add_argument("--target-blocks", type=int, default=8, help="the target's blocks (a deeper twin for measurements)")
    p.add_argument("--target-name", default="bloombee-tiny", help="the target's folder and card name")
    p.add_argument("--skip-target", action="store_true")
    args = p.parse_args(argv)
    args.draft_batch_size = args.draft_batch_size or args.batch_size

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    np.random.seed(args.seed)
    command = "python scripts/train_tiny.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out_dir)
    save_dtype = getattr(torch, args.save_dtype)
    t_start = time.time()

    train, val = collect_corpus(args.val_percent)
    corpus = dict(
        python=platform.python_version(), val_percent=args.val_percent,
        train_files=len(train), val_files=len(val),
        train_bytes=sum(len(t.encode()) for _, t in train), val_bytes=sum(len(t.encode()) for _, t in val),
        cpu=platform.processor() or platform.machine(),
    )
    print(f"corpus: {stdlib_root()} train {corpus['train_files']} files / {corpus['train_bytes']:,} B, "
          f"val {corpus['val_files']} files / {corpus['val_bytes']:,} B", flush=True)

    t = time.time()
    tokenizer = train_tokenizer([t_ for _, t_ in train], args.vocab_size, args.max_position_embeddings)
    train_stream = encode_stream(tokenizer, [t_ for _, t_ in train])
    val_stream = encode_stream(tokenizer, [t_ for _, t_ in val])
    corpus["train_tokens"], corpus["val_tokens"] = len(train_stream), len(val_stream)
    print(f"tokenizer: vocab {len(tokenizer)} in {time.time() - t:.1f}s; train {len(train_stream):,} tokens "
          f"({corpus['train_bytes'] / len(train_stream):.2f} B/token), val {len(val_stream):,} tokens", flush=True)

    # Bigram baselines on exactly the targets the models are scored on.
    V = len(tokenizer)
    counts = bigram_counts(train_stream.numpy(), V)
    w = val_windows(val_stream, args.seq_len)
    prev, nxt = w[:, :-1].reshape(-1).numpy(), w[:, 1:].reshape(-1).numpy()
    corpus["val_targets"] = int(nxt.size)
    addone = bigram_addk_loss(counts, prev, nxt, 1.0)
    lam, interp = min(((l, bigram_interp_loss(counts, prev, nxt, l)) for l in np.arange(0.05, 1.0, 0.05)), key=lambda x: x[1])
    baselines = dict(addone=addone, interp=interp, lam=round(float(lam), 2))
    print(f"bigram baseline (add-one) validation loss {addone:.4f}; interpolated (lambda={lam:.2f}) {interp:.4f}; "
          f"uniform {math.log(V):.4f}", flush=True)
    write_fixtures(out / "eval", val, counts, tokenizer, val_bytes=12_000)
    del counts
    if not (out / "__init__.py").exists():
        (out / "__init__.py").write_text(
            '"""Package data: the embedded default models (bloombee-tiny, bloombee-tiny-draft)."""\n'
            "from pathlib import Path\n\nASSETS_DIR = Path(__file__).resolve().parent\n"
        )

    jobs = []
    if not args.skip_target:
        role = ("BloomBee's embedded default model: the tiny Llama every demo, test and benchmark runs across the "
                "swarm (8 blocks, so it splits over 2-4 servers)." if args.target_blocks == 8 else
                f"bloombee-tiny's {args.target_blocks}-block twin, trained the same way, for measurements on a "
                "deeper model.")
        jobs.append((args.target_name, "target", args.steps, args.batch_size, args.lr, args.residual_init, role))
    if not args.skip_draft:
        jobs.append(("bloombee-tiny-draft", "draft", args.draft_steps, args.draft_batch_size, args.draft_lr,
                     args.draft_residual_init,
                     "The speculative-decoding draft model for `bloombee-tiny`: same tokenizer, 2 blocks, "
                     "run whole on the client."))
    summary = {}
    for name, kind, steps, bs, lr, residual_init, role in jobs:
        cfg = make_config(kind, tokenizer, args)
        model, info = train_model(name, cfg, train_stream, val_stream, args, steps, bs, lr, residual_init)
        info.update(params=n_params(model), seq_len=args.seq_len, weight_decay=args.weight_decay,
                    min_lr_frac=args.min_lr_frac, seed=args.seed, eval_windows=args.eval_windows,
                    init_note=", except the blocks' output projections (`o_proj`, `down_proj`), which start at "
                              "zero" if residual_init == "zero" else "")
        folder = out / name
        save_model(model, tokenizer, folder, save_dtype)
        t = time.time()
        info["val_loss_saved"], info["probe_saved"] = reload_val_loss(folder, w, info["probe"], args.eval_batch)
        print(f"[{name}] validation eval {time.time() - t:.1f}s; probe loss fp32 {info['probe_fp32']:.4f} "
              f"-> stored {info['probe_saved']:.4f}", flush=True)
        sample = sample_generation(folder, "def fibonacci(n):", 64)
        print(f"[{name}] validation loss as stored ({args.save_dtype}): {info['val_loss_saved']:.4f} "
              f"vs bigram add-one {addone:.4f} / interpolated {interp:.4f}\n[{name}] sample:\n{sample}\n", flush=True)
        write_card(folder, name, role, cfg, info, corpus, baselines, command, sample, args.save_dtype, args.threads)
        summary[name] = dict(params=info["params"], val_loss=info["val_loss_saved"], train_time_s=round(info["train_time"], 1))
    summary["bigram_addone"], summary["bigram_interp"] = addone, interp
    print(json.dumps(summary, indent=1))
    print(f"total wall time {human_time(time.time() - t_start)}")


if __name__ == "__main__":
    main()
