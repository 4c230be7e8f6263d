"""Decode-step latency of 2- and 3-server loopback chains against the local transformers model.

Measured side by side in one run, at batch 1 and 8: the local model's decode step (HF forward with
its KV cache, embeddings and LM head included) and the swarm's decode step (client embeddings ->
servers on 127.0.0.1 pushing to each other -> client LM head). Also measures failure recovery: a
server of a 2-server chain with a standby is SIGKILLed and the next step's extra time is recorded.

    python benchmarks/swarm_latency.py --model bloombee-tiny --steps 64
"""

import argparse
import json
import signal
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bloombee.client import AutoDistributedModel
from bloombee.loading import dht_prefix, load_model_config, resolve_model
from bloombee.local_swarm import LocalSwarm

RESULTS = Path(__file__).parent / "results"
WARMUP = 8  # steps run before timing, on both sides


def split(num_blocks: int, parts: int) -> list[str]:
    bounds = [round(index * num_blocks / parts) for index in range(parts + 1)]
    return [f"{start}:{end}" for start, end in zip(bounds, bounds[1:])]


@torch.inference_mode()
def local_step_seconds(model, batch: int, prompt: int, steps: int) -> list[float]:
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt))
    out = model(ids, use_cache=True)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(WARMUP + steps):
        began = time.perf_counter()
        out = model(token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - began)
        cache = out.cache
    return times[WARMUP:]


@torch.inference_mode()
def swarm_step_seconds(model, batch: int, prompt: int, steps: int) -> list[float]:
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt))
    times = []
    with model.remote.inference_session(max_length=prompt + WARMUP + steps + 1, batch_size=batch) as session:
        token = model.head.logits(session.step(model.head.embed(ids)))[:, -1:].argmax(-1)
        for _ in range(WARMUP + steps):
            began = time.perf_counter()
            token = model.head.logits(session.step(model.head.embed(token)))[:, -1:].argmax(-1)
            times.append(time.perf_counter() - began)
    return times[WARMUP:]


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median_ms": 1e3 * statistics.median(ordered), "p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))], "steps": len(ordered)}


def recovery_seconds(swarm: LocalSwarm, model, prompt: int) -> dict:
    """Extra time of the step during which the serving span-2 server is SIGKILLed (standby takes over)."""
    ids = torch.randint(3, model.config.vocab_size, (1, prompt))
    with torch.inference_mode(), model.remote.inference_session(max_length=prompt + 16) as session:
        token = model.head.logits(session.step(model.head.embed(ids)))[:, -1:].argmax(-1)
        normal = []
        for _ in range(8):
            began = time.perf_counter()
            token = model.head.logits(session.step(model.head.embed(token)))[:, -1:].argmax(-1)
            normal.append(time.perf_counter() - began)
        swarm.kill(session.spans[-1].record.public_name, signal.SIGKILL)
        began = time.perf_counter()
        model.head.logits(session.step(model.head.embed(token)))
        failed_step = time.perf_counter() - began
    return {"normal_step_ms": 1e3 * statistics.median(normal), "step_with_failure_ms": 1e3 * failed_step,
            "recovery_ms": 1e3 * (failed_step - statistics.median(normal)), "recoveries": session.recoveries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bloombee-tiny")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output", default=str(RESULTS / "swarm_latency.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = resolve_model(args.model)
    num_blocks = load_model_config(path).num_hidden_layers
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = {"model": args.model, "num_blocks": num_blocks, "steps": args.steps, "prompt": args.prompt, "runs": []}
    for servers in (2, 3):
        with LocalSwarm(str(path), num_blocks, dht_prefix(path)) as swarm:
            names = []
            for index, blocks in enumerate(split(num_blocks, servers)):
                names.append(f"s{index}")
                swarm.add_server("--blocks", blocks, "--dtype", "float32", "--compression", "off", name=names[-1], wait=False)
            swarm.wait_online(names)
            model = AutoDistributedModel.from_pretrained(str(path), initial_peers=swarm.initial_peers, dtype=torch.float32, compression="off")
            for batch in args.batch_sizes:
                local_times = local_step_seconds(local, batch, args.prompt, args.steps)
                swarm_times = swarm_step_seconds(model, batch, args.prompt, args.steps)
                run = {"servers": servers, "batch": batch, "local": summary(local_times), "swarm": summary(swarm_times)}
                run["ratio"] = run["swarm"]["median_ms"] / run["local"]["median_ms"]
                results["runs"].append(run)
                print(f"{servers} servers, batch {batch}: local {run['local']['median_ms']:.2f} ms, "
                      f"swarm {run['swarm']['median_ms']:.2f} ms, ratio {run['ratio']:.2f}x", flush=True)
            if servers == 2:
                swarm.add_server("--blocks", split(num_blocks, 2)[1], "--dtype", "float32", "--compression", "off", name="standby")
                results["recovery"] = recovery_seconds(swarm, model, args.prompt)
                print(f"recovery: {results['recovery']}", flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    plot(results, Path(args.output).with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    labels = [f"{run['servers']} servers\nbatch {run['batch']}" for run in runs]
    x = range(len(runs))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [run["local"]["median_ms"] for run in runs], 0.4, label="local transformers")
    ax.bar([i + 0.2 for i in x], [run["swarm"]["median_ms"] for run in runs], 0.4, label="BloomBee swarm (loopback)")
    for i, run in zip(x, runs):
        ax.text(i + 0.2, run["swarm"]["median_ms"], f"{run['ratio']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("median decode step, ms")
    ax.set_title(f"Decode step on {results['model']} ({results['num_blocks']} blocks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
