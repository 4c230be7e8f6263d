"""Chunked prefill: a 4k-token prompt arriving while 4 other sessions decode, through one server, with its prompt
sent whole against sent as chunks of --max-chunk-tokens.

One server (a random Llama, hidden 512, 4 blocks, one torch thread) runs once with --max-chunk-tokens above the
prompt (the prompt goes whole, as before chunking) and once per chunk size of --chunk-tokens (2048, the default,
and 512). Each time, 4
sessions decode greedily step by step in threads; once they run, a fifth session sends the 4096-token prompt.
Reported: its time to first token, and the decode steps of the other 4 that overlapped its prefill (p50, p99, max).
Results: `results/prefill/prefill.{json,md}`.

    python -m benchmarks.prefill_bench
"""

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from benchmarks.netbench.models import RandomLlama, make_random_llama
from bloombee.client import AutoDistributedModel
from bloombee.loading import dht_prefix
from bloombee.local_swarm import LocalSwarm

OUT_DIR = Path(__file__).parent / "results" / "prefill"
MODEL = RandomLlama(hidden=512, layers=4, intermediate=1536, heads=8, kv_heads=8, vocab=1000, max_positions=8192)
PROMPT_TOKENS, DECODERS, DECODER_PROMPT = 4096, 4, 16
STALL_ALLOWED_S = 120.0  # the client's step deadline here: a decode step held behind a whole prompt is measured, not
# failed (with the default 4 s the decoders ban the server while it computes the whole prompt)


def decode(model, stop: threading.Event, steps: list[tuple[float, float]], seed: int) -> None:
    """Greedy decode steps in one session until `stop`; `steps` gets each step's (start, end) time."""
    token = torch.randint(0, MODEL.vocab, (1, DECODER_PROMPT), generator=torch.Generator().manual_seed(seed))
    with model.remote.inference_session(max_length=2048) as session:
        while not stop.is_set() and session.position < session.max_length - 1:
            began = time.perf_counter()
            token = model.head.logits(session.step(model.head.embed(token)))[:, -1:].argmax(-1)
            steps.append((began, time.perf_counter()))


def first_token_seconds(model) -> tuple[float, float, float]:
    """(start, end, seconds) of the long prompt's prefill up to its first token."""
    prompt = torch.randint(0, MODEL.vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(99))
    with model.remote.inference_session(max_length=PROMPT_TOKENS + 1) as session:
        began = time.perf_counter()
        model.head.logits(session.step(model.head.embed(prompt)))[:, -1:].argmax(-1)
        ended = time.perf_counter()
    return began, ended, ended - began


def run(path: Path, chunk_tokens: int, log_dir: Path) -> dict:
    """One server with --max-chunk-tokens `chunk_tokens`: the long prompt's TTFT and the overlapping decode steps."""
    log_dir.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(str(path), MODEL.layers, dht_prefix(str(path)), log_dir=str(log_dir))
    swarm.start_bootstrap()
    try:
        swarm.add_server("--blocks", f"0:{MODEL.layers}", "--dtype", "float32", "--max-length", str(PROMPT_TOKENS + 1),
                         "--max-chunk-tokens", str(chunk_tokens), "--max-batch-size", "1", "--no-profile", name="s")
        with AutoDistributedModel.from_pretrained(str(path), initial_peers=swarm.initial_peers, dtype=torch.float32,
                                                  draft_model="none", step_timeout_min=STALL_ALLOWED_S,
                                                  request_timeout=STALL_ALLOWED_S) as model:
            stop, steps = threading.Event(), [[] for _ in range(DECODERS)]
            threads = [threading.Thread(target=decode, args=(model, stop, steps[i], i)) for i in range(DECODERS)]
            for thread in threads:
                thread.start()
            time.sleep(3.0)  # the decoders are past their prompts
            began, ended, ttft = first_token_seconds(model)
            time.sleep(1.0)
            stop.set()
            for thread in threads:
                thread.join()
    finally:
        swarm.stop()
    overlapping = sorted(end - start for decoder in steps for start, end in decoder if end > began and start < ended)
    before = sorted(end - start for decoder in steps for start, end in decoder if end < began)
    return {"max_chunk_tokens": chunk_tokens, "ttft_s": ttft, "decode_steps_during_prefill": len(overlapping),
            "decode_p50_ms": 1e3 * statistics.median(overlapping),
            "decode_p99_ms": 1e3 * overlapping[min(len(overlapping) - 1, int(0.99 * len(overlapping)))],
            "decode_max_ms": 1e3 * overlapping[-1], "decode_p50_before_ms": 1e3 * statistics.median(before)}


def markdown(results: list[dict], command: str) -> str:
    lines = ["# Chunked prefill: a 4096-token prompt while 4 sessions decode, one server", "", f"`{command}`", "",
             "| prompt sent | --max-chunk-tokens | time to first token s | decode steps during prefill | "
             "p50 ms | p99 ms | max ms | p50 ms before it |", "|---|---|---|---|---|---|---|---|"]
    for result in results:
        sent = "whole" if result["max_chunk_tokens"] > PROMPT_TOKENS else "chunks"
        lines.append(f"| {sent} | {result['max_chunk_tokens']} | {result['ttft_s']:.2f} | "
                     f"{result['decode_steps_during_prefill']} | {result['decode_p50_ms']:.1f} | "
                     f"{result['decode_p99_ms']:.1f} | {result['decode_max_ms']:.1f} | "
                     f"{result['decode_p50_before_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-tokens", default="2048,512", help="--max-chunk-tokens of the chunked runs, comma-separated")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    path = make_random_llama(MODEL)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(__file__).parent / "results" / "tmp" / "prefill-logs"
    chunks = [PROMPT_TOKENS * 2] + [int(chunk) for chunk in args.chunk_tokens.split(",")]
    results = [run(path, chunk, logs / str(chunk)) for chunk in chunks]
    command = "python -m benchmarks.prefill_bench" + (f" --chunk-tokens {args.chunk_tokens}"
                                                      if args.chunk_tokens != "2048,512" else "")
    (args.out / "prefill.json").write_text(json.dumps({"command": command, "results": results}, indent=2))
    (args.out / "prefill.md").write_text(markdown(results, command))
    print(markdown(results, command))


if __name__ == "__main__":
    main()
