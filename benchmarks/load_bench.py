"""Concurrent sessions against a small swarm as their number K grows past the servers' memory budget.

Two bloombee-tiny servers (blocks 0:4 and 4:8, one torch thread each) with a device-memory budget
of SESSIONS_PER_SERVER sessions; one client process runs K sessions at once in threads, each a
16-token prompt and 32 greedy tokens step by step. Per K: sessions admitted and refused, the most
sessions a server held at once, the tokens/s of all sessions together, p50/p99 of the decode-step
latency, and how many sessions gave exactly the local model's tokens.

    python -m benchmarks.load_bench --ks 1 2 4 8 16 32
"""

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bloombee.client import AutoDistributedModel, RequestRejected
from bloombee.loading import dht_prefix, load_block_stack, load_model_config, resolve_model
from bloombee.local_swarm import LocalSwarm

RESULTS = Path(__file__).parent / "results"
MODEL = "bloombee-tiny"
PROMPT, NEW_TOKENS = 16, 32
SESSIONS_PER_SERVER = 4
ALLOC_TIMEOUT = 5.0


def device_memory(path: Path) -> int:
    """Weights of four blocks plus room for SESSIONS_PER_SERVER sessions of PROMPT + NEW_TOKENS tokens (and half)."""
    config, parameters = load_model_config(path), list(load_block_stack(path, 0, 4, dtype="auto").parameters())
    weights = sum(p.numel() * p.element_size() for p in parameters)
    head_dim = config.hidden_size // config.num_attention_heads
    session = (PROMPT + NEW_TOKENS) * 4 * 2 * config.num_key_value_heads * head_dim * parameters[0].element_size()
    return weights + SESSIONS_PER_SERVER * session + session // 2


def one_session(model, prompt: torch.Tensor, out: dict) -> None:
    """Prefill, then NEW_TOKENS - 1 decode steps, timed; `out` gets the tokens and step times, or the refusal."""
    try:
        with model.remote.inference_session(max_length=PROMPT + NEW_TOKENS) as session:
            token = model.head.logits(session.step(model.head.embed(prompt)))[:, -1:].argmax(-1)
            tokens, steps = [token], []
            for _ in range(NEW_TOKENS - 1):
                began = time.perf_counter()
                token = model.head.logits(session.step(model.head.embed(token)))[:, -1:].argmax(-1)
                steps.append(time.perf_counter() - began)
                tokens.append(token)
            out.update(tokens=torch.cat(tokens, dim=1), steps=steps)
    except RequestRejected as error:
        out["refused"] = str(error)


def watch_sessions(model, peers: list[str], stop: threading.Event, most: dict) -> None:
    """Poll the servers' open sessions until `stop`; `most` gets the largest count each server showed."""
    while not stop.is_set():
        for peer in peers:
            most[peer] = max(most.get(peer, 0), model.remote.server_info(peer)["open_sessions"])
        stop.wait(0.1)


@torch.inference_mode()
def run_k(model, local, k: int, peers: list[str]) -> dict:
    generator = torch.Generator().manual_seed(k)
    prompts = [torch.randint(3, local.config.vocab_size, (1, PROMPT), generator=generator) for _ in range(k)]
    outs = [{} for _ in range(k)]
    most, stop = {}, threading.Event()
    watcher = threading.Thread(target=watch_sessions, args=(model, peers, stop, most))
    threads = [threading.Thread(target=one_session, args=(model, prompt, out)) for prompt, out in zip(prompts, outs)]
    watcher.start()
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    stop.set()
    watcher.join()
    done = [(out, prompt) for out, prompt in zip(outs, prompts) if "tokens" in out]
    steps = sorted(step for out, _ in done for step in out["steps"])
    exact = sum(torch.equal(out["tokens"], local.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[:, PROMPT:])
                for out, prompt in done)
    return {"k": k, "admitted": len(done), "refused": k - len(done), "most_held_per_server": max(most.values(), default=0),
            "tokens_per_s": len(done) * NEW_TOKENS / wall, "wall_s": wall, "exact": exact,
            "step_p50_ms": 1e3 * statistics.median(steps) if steps else None,
            "step_p99_ms": 1e3 * steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else None,
            "refusals": sorted({out["refused"].split(": ", 1)[1][:120] for out in outs if "refused" in out})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--output", default=str(RESULTS / "load.json"))
    parser.add_argument("--logs", default=None, help="folder for the servers' logs (default: a temporary one)")
    args = parser.parse_args()
    path = resolve_model(MODEL)
    local = AutoModelForCausalLM.from_pretrained(path).eval()
    memory = device_memory(path)
    with LocalSwarm(str(path), 8, dht_prefix(path), log_dir=args.logs) as swarm:
        for blocks in ("0:4", "4:8"):  # the whole cache on the device, so that its budget is the limit
            swarm.add_server("--blocks", blocks, "--offload", "0", "--device-memory", str(memory), "--alloc-timeout",
                             str(ALLOC_TIMEOUT))
        with AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers) as model:
            model.remote.manager.update(force=True)
            peers = list(model.remote.manager.usable_servers())
            rows = []
            for k in args.ks:
                rows.append(run_k(model, local, k, peers))
                print(json.dumps(rows[-1]), flush=True)
    results = {"model": MODEL, "servers": 2, "sessions_per_server": SESSIONS_PER_SERVER, "prompt": PROMPT,
               "new_tokens": NEW_TOKENS, "alloc_timeout_s": ALLOC_TIMEOUT, "device_memory_bytes": memory, "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
    plot(results, Path(args.output).with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    ks = [row["k"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(ks, [row["tokens_per_s"] for row in rows], "o-", label="tokens/s (all sessions)")
    left.bar(ks, [row["admitted"] for row in rows], alpha=0.3, label="sessions admitted")
    left.bar(ks, [row["refused"] for row in rows], bottom=[row["admitted"] for row in rows], alpha=0.3, color="red",
             label="sessions refused")
    left.axvline(results["sessions_per_server"], color="grey", linestyle=":", label="memory budget (sessions)")
    left.set_xlabel("concurrent sessions K")
    left.legend()
    right.plot(ks, [row["step_p50_ms"] for row in rows], "o-", label="p50")
    right.plot(ks, [row["step_p99_ms"] for row in rows], "s--", label="p99")
    right.set_xlabel("concurrent sessions K")
    right.set_ylabel("decode step, ms")
    right.legend()
    fig.suptitle(f"{results['model']}: 2 servers with room for {results['sessions_per_server']} sessions each")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
