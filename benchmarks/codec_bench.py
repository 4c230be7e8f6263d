"""Activation codec benchmark: sizes and single-core speeds of every layout, side by side.

    .venv/bin/python benchmarks/codec_bench.py                  # bloombee-tiny, writes results/codec.{json,png}
    .venv/bin/python benchmarks/codec_bench.py --model PATH     # any transformers-loadable causal LM
    .venv/bin/python benchmarks/codec_bench.py --quick          # smaller sets, fewer repeats

Data sets:
- real/<dtype>/prompt: hidden states at every block boundary (embedding output and every block's
  output, before the final norm) for one prompt of --prompt-tokens tokens of Python stdlib source;
- real/<dtype>/decode: the same boundaries for --decode-steps greedy decode steps of a batch of
  --decode-batch sequences ([b, 1, H] each), the model run in that dtype with plain transformers;
- synthetic/<dtype>/h<H>_t<T>: LLaMA-sized [1, T, H] tensors, Gaussian with per-token scale and a few
  outlier channels (as in LLaMA-13B/30B activations), H in {5120, 6656}, T in {1, 16, 512}.

Methods (each tensor compressed on its own, one thread):
- raw; zstd-L: plain zstd of the tensor's bytes (level L);
- expmant-L: ZipNN's split, exponent bits in one stream and sign+mantissa bits in another, zstd each;
- bytesplit-L: ours (one lane per byte, near-random lanes stored raw), through bloombee.codec;
- bytesplit_rot-L: ours with each element's bits rotated left by one first (sign to the low lane,
  exponent aligned to the high lane; an extra layout); auto: what codec "auto" sends;
- dict-L (decode sets only): bytesplit whose high lane uses a zstd dictionary trained on the first
  half of the set's tensors, measured on the second half (an experiment, not a codec layout).
The bound is the order-0 entropy of each tensor's byte lanes, summed (what an ideal per-lane
order-0 coder would reach).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bloombee import codec  # noqa: E402
from bloombee.codec import core, lane_zstd  # noqa: E402
from bloombee.codec.entropy import byte_entropy  # noqa: E402

DEFAULT_MODEL = ROOT / "bloombee" / "assets" / "bloombee-tiny"
RESULTS = ROOT / "benchmarks" / "results"
INT = {torch.float16: np.uint16, torch.bfloat16: np.uint16, torch.float32: np.uint32}


# --------------------------------------------------------------------------------- data sets


def stdlib_text(min_chars: int) -> str:
    import argparse as a, textwrap, json as j, collections, dataclasses, inspect as i  # noqa: E401

    parts = []
    for mod in (collections, a, dataclasses, textwrap, j.decoder, i):
        parts.append(Path(mod.__file__).read_text())
        if sum(map(len, parts)) >= min_chars:
            break
    return "\n".join(parts)


def make_random_llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def load_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model


def tokenize(path: Path, text: str, vocab: int) -> list[int]:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        return tok(text)["input_ids"]
    except Exception:  # no tokenizer in the folder: bytes folded into the vocabulary
        return [b % vocab for b in text.encode()]


def block_boundaries(model, run):
    """Run ``run()`` capturing the embedding output and each decoder layer's output."""
    captured = []
    layers = model.model.layers

    def hook(_module, _inputs, output):
        captured.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    def embed_hook(_module, _inputs, output):
        captured.append(output.detach().clone())

    handles = [model.model.embed_tokens.register_forward_hook(embed_hook)]
    handles += [layer.register_forward_hook(hook) for layer in layers]
    try:
        out = run()
    finally:
        for h in handles:
            h.remove()
    return captured, out


@torch.no_grad()
def real_sets(path: Path, dtype: torch.dtype, prompt_tokens: int, decode_batch: int, decode_steps: int):
    model = load_model(path, dtype)
    vocab = model.config.vocab_size
    ids = tokenize(path, stdlib_text(40 * (prompt_tokens + decode_batch * 64)), vocab)
    prompt = torch.tensor([ids[:prompt_tokens]])
    prompt_states, _ = block_boundaries(model, lambda: model(prompt, use_cache=False))

    # decode: a batch of different stdlib snippets, 64-token prefills, then greedy steps
    starts = [prompt_tokens + i * 64 for i in range(decode_batch)]
    batch = torch.tensor([ids[s : s + 64] for s in starts])
    out = model(batch, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    decode_states = []
    for _ in range(decode_steps):
        states, out = block_boundaries(model, lambda: model(nxt, past_key_values=past, use_cache=True))
        decode_states += states
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return prompt_states, decode_states, model.config


def synthetic(hidden: int, tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, hidden, generator=g)
    x *= 0.5 + torch.rand(1, tokens, 1, generator=g)  # per-token scale
    outliers = torch.randperm(hidden, generator=g)[:6]
    x[..., outliers] *= 40 + 40 * torch.rand(6, generator=g)  # a few large channels
    return x.to(dtype)


# ------------------------------------------------------------------------------------ methods


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class PlainZstd:
    def __init__(self, level):
        self.name, self.c, self.d = f"zstd-{level}", zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()

    def encode(self, t):
        return self.c.compress(_bytes(t)), (t.dtype, t.shape)

    def decode(self, blob, meta):
        dtype, shape = meta
        out = np.empty(math.prod(shape) * dtype.itemsize, np.uint8)
        out[:] = np.frombuffer(self.d.decompress(blob), np.uint8)
        return torch.from_numpy(out).view(dtype).reshape(shape)

    size = staticmethod(lambda blob: len(blob))


class ExpMant:
    """ZipNN-style: exponent bits -> one byte stream; sign+mantissa bits -> another; zstd each."""

    EXP = {torch.float16: (10, 0x1F), torch.bfloat16: (7, 0xFF), torch.float32: (23, 0xFF)}

    def __init__(self, level):
        self.name, self.c, self.d = f"expmant-{level}", zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()

    def encode(self, t):
        u = _bytes(t).view(INT[t.dtype])
        shift, mask = self.EXP[t.dtype]
        bits = 8 * u.itemsize
        exp = ((u >> shift) & mask).astype(np.uint8)
        man_mask = (1 << shift) - 1
        sm = ((u >> (bits - 1 - shift)) & (1 << shift)) | (u & man_mask)  # sign moved above mantissa
        if t.dtype == torch.bfloat16:
            sm = sm.astype(np.uint8)  # 1 + 7 bits: one byte
        elif t.dtype == torch.float32:
            sm = sm.view(np.uint8).reshape(-1, 4)[:, :3].copy()  # 1 + 23 bits: three bytes
        return (self.c.compress(exp), self.c.compress(sm)), (t.dtype, t.shape)

    def decode(self, blob, meta):
        dtype, shape = meta
        n = math.prod(shape)
        shift, mask = self.EXP[dtype]
        ity = INT[dtype]
        bits = 8 * np.dtype(ity).itemsize
        exp = np.frombuffer(self.d.decompress(blob[0]), np.uint8).astype(ity)
        smb = np.frombuffer(self.d.decompress(blob[1]), np.uint8)
        if dtype == torch.float16:
            sm = smb.view(np.uint16)
        elif dtype == torch.bfloat16:
            sm = smb.astype(np.uint16)
        else:
            sm = np.zeros((n, 4), np.uint8)
            sm[:, :3] = smb.reshape(n, 3)
            sm = sm.view(np.uint32).reshape(-1)
        man_mask = ity((1 << shift) - 1)
        sign = (sm >> ity(shift)) & ity(1)
        out = (sign << ity(bits - 1)) | (exp << ity(shift)) | (sm & man_mask)
        return torch.from_numpy(out.astype(ity)).view(dtype).reshape(shape)

    size = staticmethod(lambda blob: len(blob[0]) + len(blob[1]))


class Codec:
    def __init__(self, layout, level):
        self.layout, self.level = layout, level
        self.name = layout if layout in ("auto", "raw") else f"{layout}-{level}"

    def encode(self, t):
        return codec.encode(t, self.layout, level=self.level), None

    def decode(self, blob, meta):
        return codec.decode(blob)

    size = staticmethod(lambda blob: len(blob))


class DictHighLane:
    """bytesplit with the compressed lanes using a zstd dictionary trained on other tensors."""

    def __init__(self, level, train: list[torch.Tensor], dict_size: int):
        samples = [self._lanes(t)[k].tobytes() for t in train for k in self._hot(t)]
        self.dict = zstandard.train_dictionary(dict_size, samples, level=level)
        self.name = f"dict-{level}"
        self.c = zstandard.ZstdCompressor(level=level, dict_data=self.dict)
        self.d = zstandard.ZstdDecompressor(dict_data=self.dict)
        self.level = level

    @staticmethod
    def _lanes(t):
        u8 = _bytes(t).reshape(-1, t.element_size())
        return np.ascontiguousarray(u8.T)

    @staticmethod
    def _hot(t):  # the lanes bytesplit compresses (not the near-random ones)
        return [t.element_size() - 1] if t.element_size() == 2 else [3, 2]

    def encode(self, t):
        lanes = self._lanes(t)
        hot = self._hot(t)
        return [self.c.compress(lanes[k]) if k in hot else lanes[k].tobytes() for k in range(len(lanes))], (t.dtype, t.shape)

    def decode(self, blob, meta):
        dtype, shape = meta
        n = math.prod(shape)
        out = np.empty((n, dtype.itemsize), np.uint8)
        hot = [dtype.itemsize - 1] if dtype.itemsize == 2 else [3, 2]
        for k, b in enumerate(blob):
            out[:, k] = np.frombuffer(self.d.decompress(b) if k in hot else b, np.uint8)
        return torch.from_numpy(out.reshape(-1)).view(dtype).reshape(shape)

    size = staticmethod(lambda blob: sum(len(b) for b in blob))


def lane_bound(t: torch.Tensor) -> float:
    """Order-0 entropy bound (bytes) of a tensor's byte lanes, each lane coded on its own."""
    u8 = _bytes(t).reshape(-1, t.element_size())
    return sum(u8.shape[0] * byte_entropy(np.ascontiguousarray(u8[:, k])) / 8 for k in range(u8.shape[1]))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ity = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(ity), b.contiguous().view(ity))


def measure_all(methods, tensors: list[torch.Tensor], repeats: int) -> dict:
    """Sizes, and the best-of-``repeats`` encode/decode times of every method, the methods taking
    turns within each repeat so that a busy machine slows them alike. Times are this thread's CPU
    time (time.thread_time), which other processes on a shared machine disturb far less than wall
    time; the benchmark is single-threaded so the two agree on an idle machine."""
    raw = sum(t.numel() * t.element_size() for t in tensors)
    blobs = {}
    for m in methods:
        blobs[m.name] = [m.encode(t) for t in tensors]
        for (blob, meta), t in zip(blobs[m.name], tensors):
            assert bits_equal(m.decode(blob, meta), t), f"{m.name} is not lossless"
    enc = {m.name: float("inf") for m in methods}
    dec = dict(enc)
    for _ in range(repeats):
        for m in methods:
            start = time.thread_time()
            for t in tensors:
                m.encode(t)
            enc[m.name] = min(enc[m.name], time.thread_time() - start)
            start = time.thread_time()
            for blob, meta in blobs[m.name]:
                m.decode(blob, meta)
            dec[m.name] = min(dec[m.name], time.thread_time() - start)
    out = {}
    for m in methods:
        size = sum(m.size(b) for b, _ in blobs[m.name])
        out[m.name] = {
            "bytes": size,
            "size_pct": 100.0 * size / raw,
            "encode_s": enc[m.name],
            "decode_s": dec[m.name],
            "encode_MBps": raw / enc[m.name] / 1e6,
            "decode_MBps": raw / dec[m.name] / 1e6,
        }
        if m.name == "auto":
            out[m.name]["layouts"] = sorted({codec.inspect(b).layout for b, _ in blobs[m.name]})
    return out


def run_set(name: str, tensors: list[torch.Tensor], levels, repeats: int, dict_train=None) -> dict:
    raw = sum(t.numel() * t.element_size() for t in tensors)
    methods = [Codec("raw", None)]
    for lvl in levels:
        methods += [PlainZstd(lvl), ExpMant(lvl)]
        methods += [Codec(layout, lvl) for layout in ("bytesplit", "bytesplit_rot")]
    methods.append(Codec("auto", None))
    if dict_train:
        methods += [DictHighLane(lvl, dict_train, 16 << 10) for lvl in levels]
    result = {
        "tensors": len(tensors),
        "shape": list(tensors[0].shape),
        "dtype": str(tensors[0].dtype).removeprefix("torch."),
        "raw_bytes": raw,
        "tensor_bytes": tensors[0].numel() * tensors[0].element_size(),
        "lane_entropy_bound_bytes": sum(lane_bound(t) for t in tensors),
        "lane_entropy_bits": lane_entropies(tensors),
        "methods": {},
    }
    result["lane_entropy_bound_pct"] = 100.0 * result["lane_entropy_bound_bytes"] / raw
    result["methods"] = measure_all(methods, tensors, repeats)
    print(f"{name}: " + ", ".join(f"{k} {v['size_pct']:.1f}%" for k, v in result["methods"].items()), flush=True)
    return result


def lane_entropies(tensors) -> list[float]:
    u8 = np.concatenate([_bytes(t).reshape(-1, t.element_size()) for t in tensors])
    return [round(byte_entropy(np.ascontiguousarray(u8[:, k])), 4) for k in range(u8.shape[1])]


# ------------------------------------------------------------------------------------- verdicts


def verdicts(sets: dict, level: int) -> dict:
    out = {}
    for name, s in sets.items():
        m = s["methods"]
        ours = m[f"bytesplit-{level}"]
        v = {
            "ours_vs_zstd_size": ours["bytes"] / m[f"zstd-{level}"]["bytes"],
            "ours_vs_expmant_size": ours["bytes"] / m[f"expmant-{level}"]["bytes"],
            "ours_vs_bound": ours["bytes"] / s["lane_entropy_bound_bytes"],
            "ours_vs_zstd_encode_time": ours["encode_s"] / m[f"zstd-{level}"]["encode_s"],
            "ours_decode_MBps": ours["decode_MBps"],
            "rot_vs_bytesplit_size": m[f"bytesplit_rot-{level}"]["bytes"] / ours["bytes"],
            "auto_vs_zstd_size": m["auto"]["bytes"] / m[f"zstd-{level}"]["bytes"],
            "auto_vs_expmant_size": m["auto"]["bytes"] / m[f"expmant-{level}"]["bytes"],
            "auto_vs_bound": m["auto"]["bytes"] / s["lane_entropy_bound_bytes"],
            "auto_vs_zstd_encode_time": m["auto"]["encode_s"] / m[f"zstd-{level}"]["encode_s"],
            "auto_decode_MBps": m["auto"]["decode_MBps"],
        }
        if f"dict-{level}" in m:
            v["dict_vs_ours_size_heldout"] = m[f"dict-{level}"]["bytes"] / s["heldout_ours_bytes"][str(level)]
        v["auto_smaller_than_zstd"] = v["auto_vs_zstd_size"] < 1
        v["auto_smaller_than_expmant"] = v["auto_vs_expmant_size"] < 1
        v["auto_within_3pct_of_bound"] = v["auto_vs_bound"] <= 1.03
        v["auto_encode_within_1.25x_zstd"] = v["auto_vs_zstd_encode_time"] <= 1.25
        if s["tensor_bytes"] >= 1 << 20:
            v["auto_decode_at_least_1GBps"] = v["auto_decode_MBps"] >= 1000
        out[name] = v
    return out


def summary(results: dict, level: int) -> str:
    """Markdown: per set sizes, speeds and the targets, for benchmarks/results/codec.md."""
    lines = [
        "# Activation codec benchmark",
        "",
        f"Reproduce: `{results['command']}`. Model: {results['model']}.",
        f"Machine: {results['machine']['cores']} cores, one thread used; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in results['machine']['load_average_at_end'])}; one-core memcpy "
        f"{results['machine']['memcpy_GBps_one_core']:.1f} GB/s. Times are thread CPU time, best of the repeats.",
        f"Codec: version {results['codec']['version']}, level {level}, lane zstd params min_match "
        f"{results['codec']['lane_min_match']}, hash_log {results['codec']['lane_hash_log']}, search step "
        f"{results['codec']['lane_acceleration']}; auto (small tensors) = {results['codec']['auto']}; bf16 tensors of "
        f"{results['codec']['rotate_bf16_below_bytes']} bytes and more go plain bytesplit.",
        "",
        "Sizes are % of raw (smaller is better); `bound` is the order-0 entropy of the tensor's byte lanes.",
        "",
        "| set | tensor | zstd | expmant (ZipNN) | bytesplit | bytesplit_rot | auto | bound | ours/zstd | ours/expmant | ours/bound | enc time ours/zstd | dec MB/s ours (zstd) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results["sets"].items():
        m = s["methods"]
        v = results["verdicts"][str(level)][name]
        pct = lambda k: f"{m[k]['size_pct']:.1f}"  # noqa: E731
        lines.append(
            f"| {name} | {s['shape']} x{s['tensors']} | {pct(f'zstd-{level}')} | {pct(f'expmant-{level}')} | "
            f"{pct(f'bytesplit-{level}')} | {pct(f'bytesplit_rot-{level}')} | "
            f"{pct('auto')} | {s['lane_entropy_bound_pct']:.1f} | {v['auto_vs_zstd_size']:.3f} | "
            f"{v['auto_vs_expmant_size']:.3f} | {v['auto_vs_bound']:.3f} | {v['auto_vs_zstd_encode_time']:.2f} | "
            f"{m['auto']['decode_MBps']:.0f} ({m[f'zstd-{level}']['decode_MBps']:.0f}) |"
        )
    lines += ["", "`ours` = what `auto` sends. Level 3 figures, the dictionary experiment and every speed are in codec.json.", ""]
    return "\n".join(lines)


def _timed(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def plot(sets: dict, level: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(sets)
    methods = [f"zstd-{level}", f"expmant-{level}", f"bytesplit-{level}", f"bytesplit_rot-{level}"]
    colors = ["#999999", "#d98c3f", "#2b7bb9", "#1a9850", "#7fb8e0"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 0.42 * len(names) + 2.5), gridspec_kw={"width_ratios": [3, 2]})
    y = np.arange(len(names))
    h = 0.8 / (len(methods) + 1)
    for i, (meth, col) in enumerate(zip(methods, colors)):
        ax1.barh(y + i * h, [sets[n]["methods"][meth]["size_pct"] for n in names], h, label=meth, color=col)
    ax1.barh(y + len(methods) * h, [sets[n]["lane_entropy_bound_pct"] for n in names], h, label="lane entropy bound (bytesplit)", color="#000000")
    ax1.set_yticks(y + 0.4 - h / 2, names, fontsize=8)
    ax1.invert_yaxis()
    lo = min(min(sets[n]["lane_entropy_bound_pct"] for n in names),
             min(sets[n]["methods"][mm]["size_pct"] for n in names for mm in methods))
    ax1.set_xlim(lo - 5, 112)
    ax1.set_xlabel("compressed size, % of raw (smaller is better)")
    ax1.legend(fontsize=8, loc="upper right")
    ax1.grid(axis="x", alpha=0.3)
    for meth, col in zip(methods, colors):
        xs = [sets[n]["methods"][meth]["encode_MBps"] for n in names if sets[n]["tensor_bytes"] >= 1 << 20]
        ys = [sets[n]["methods"][meth]["decode_MBps"] for n in names if sets[n]["tensor_bytes"] >= 1 << 20]
        ax2.scatter(xs, ys, label=meth, color=col, s=30)
    ax2.axhline(1000, color="red", lw=0.8, ls="--", label="1 GB/s decode target")
    ax2.set_xlabel("encode MB/s, one core (tensors >= 1 MB)")
    ax2.set_ylabel("decode MB/s, one core")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--out", type=Path, default=RESULTS / "codec.json")
    p.add_argument("--plot", type=Path, default=RESULTS / "codec.png")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 3])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="small sets, 2 repeats (a smoke run)")
    p.add_argument("--from-json", type=Path, help="only redraw the plot and summary from a results file")
    args = p.parse_args(argv)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        level = results["codec"]["default_level"]
        for l in results["verdicts"]:  # recompute verdicts with the current rules
            results["verdicts"][l] = verdicts(results["sets"], int(l))
        args.from_json.with_suffix(".md").write_text(summary(results, level))
        plot(results["sets"], level, args.plot, f"bloombee.codec, level {level}; model: {results['model']}")
        return 0
    if args.quick:
        args.prompt_tokens, args.decode_steps, args.repeats = 128, 4, 2
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model_note = str(args.model)
    model_path = args.model
    if not (model_path / "config.json").exists():
        tmp = RESULTS / "tmp" / "random-llama"
        if not (tmp / "config.json").exists():
            make_random_llama(tmp)
        model_path = tmp
        model_note = f"{args.model} not found: a randomly initialised Llama (hidden 512, 6 layers), NOT trained"
    print(f"model: {model_note}", flush=True)

    sets: dict[str, dict] = {}
    config = None
    for dtype in (torch.float16, torch.bfloat16):
        dname = str(dtype).removeprefix("torch.")
        prompt_states, decode_states, config = real_sets(model_path, dtype, args.prompt_tokens, args.decode_batch, args.decode_steps)
        sets[f"real/{dname}/prompt"] = run_set(f"real/{dname}/prompt", prompt_states, args.levels, args.repeats)
        half = len(decode_states) // 2
        train, test = decode_states[:half], decode_states[half:]
        s = run_set(f"real/{dname}/decode", test, args.levels, args.repeats * 2, dict_train=train)
        s["heldout_ours_bytes"] = {str(l): s["methods"][f"bytesplit-{l}"]["bytes"] for l in args.levels}
        sets[f"real/{dname}/decode"] = s
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        dname = str(dtype).removeprefix("torch.")
        for hidden in (5120, 6656):
            for tokens in ((1, 16, 512) if dtype != torch.float32 else (16, 512)):
                if args.quick and tokens == 512 and hidden == 6656:
                    continue
                count = 4 if tokens == 512 else 16
                tensors = [synthetic(hidden, tokens, dtype, seed) for seed in range(count)]
                name = f"synthetic/{dname}/h{hidden}_t{tokens}"
                sets[name] = run_set(name, tensors, args.levels, args.repeats)

    buf = np.ones(64 << 20, np.uint8)
    copy_s = min(_timed(lambda: buf.copy()) for _ in range(5))
    results = {
        "command": "python benchmarks/codec_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": model_note,
        "model_config": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "zstd": zstandard.ZSTD_VERSION,
                    "cpu": platform.processor() or platform.machine(), "threads": 1, "cores": os.cpu_count(),
                    "load_average_at_end": os.getloadavg(), "memcpy_GBps_one_core": buf.nbytes / copy_s / 1e9},
        "codec": {"version": codec.CODEC_VERSION, "default_level": codec.DEFAULT_LEVEL,
                  "lane_min_match": lane_zstd.LANE_MIN_MATCH, "lane_hash_log": lane_zstd.LANE_HASH_LOG,
                  "lane_acceleration": lane_zstd.LANE_ACCELERATION,
                  "raw_lane_entropy_bits": core.RAW_LANE_ENTROPY_BITS,
                  "auto": {d: core.auto_candidates(getattr(torch, d), (1, 1)) for d in ("float16", "bfloat16", "float32")},
                  "rotate_bf16_below_bytes": core.ROTATE_BELOW_BYTES},
        "sets": sets,
        "verdicts": {str(l): verdicts(sets, l) for l in args.levels},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    args.out.with_suffix(".md").write_text(summary(results, codec.DEFAULT_LEVEL))
    plot(sets, codec.DEFAULT_LEVEL, args.plot, f"bloombee.codec, level {codec.DEFAULT_LEVEL}; model: {model_note}")
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
