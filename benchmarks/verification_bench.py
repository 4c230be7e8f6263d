"""The cost of verifying untrusted servers: tokens/s of a greedy generation with verification off, at p and at p = 1.

bloombee-tiny in its own dtype, an honest swarm of 2 spans (blocks 0:4 and 4:8) with 2 replicas each, one torch
thread per server, all on this machine. The settings alternate round by round, side by side in one run; each
generation runs in a fresh session, so every run also pays the always-on check of each server's first step.

    python benchmarks/verification_bench.py --tokens 128 --rounds 3
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bloombee.client import AutoDistributedModel
from bloombee.loading import dht_prefix, resolve_model
from bloombee.local_swarm import LocalSwarm

RESULTS = Path(__file__).parent / "results"
MODEL = "bloombee-tiny"
SERVERS = {"a1": "0:4", "a2": "0:4", "b1": "4:8", "b2": "4:8"}
PROMPT = "def fibonacci(n):\n"


def run_once(swarm: LocalSwarm, ids: torch.Tensor, tokens: int, probability: float, seed: int) -> dict:
    """One greedy generation of `tokens` tokens at verify_probability `probability`: its speed and checks."""
    with AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers, verify_probability=probability,
                                              verify_seed=seed) as model:
        with model.inference_session(max_length=ids.shape[1] + tokens) as session:
            began = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            seconds = time.perf_counter() - began
        verifier = session.verifier
        return {"tokens_per_s": tokens / seconds, "seconds": seconds, "checks": verifier.checks,
                "untrusted": len(verifier.untrusted), "largest_agreeing": verifier.largest_agreeing, "tokens": out.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probability", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = AutoTokenizer.from_pretrained(resolve_model(MODEL))(PROMPT, return_tensors="pt").input_ids
    settings = {"off": 0.0, f"p={args.probability:g}": args.probability, "p=1": 1.0}
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    with LocalSwarm(MODEL, 8, dht_prefix(MODEL)) as swarm:
        for name, blocks in SERVERS.items():
            swarm.add_server("--blocks", blocks, name=name, wait=False)
        swarm.wait_online(list(SERVERS))
        run_once(swarm, ids, 16, 0.0, 0)  # warm-up: the servers' first sessions and the client's imports
        for round_index in range(args.rounds):
            for name, probability in settings.items():
                runs[name].append(run_once(swarm, ids, args.tokens, probability, round_index))
    reference = runs["off"][0]["tokens"]
    summary = {name: {"tokens_per_s_median": statistics.median(run["tokens_per_s"] for run in done),
                      "checks_per_run": [run["checks"] for run in done],
                      "untrusted": sum(run["untrusted"] for run in done),
                      "largest_agreeing_difference": max(run["largest_agreeing"] for run in done),
                      "same_tokens": all(run["tokens"] == reference for run in done)}
               for name, done in runs.items()}
    base = summary["off"]["tokens_per_s_median"]
    for name, row in summary.items():
        row["overhead"] = base / row["tokens_per_s_median"] - 1
    result = {"model": MODEL, "servers": SERVERS, "new_tokens": args.tokens, "rounds": args.rounds,
              "threads_per_server": 1, "summary": summary,
              "runs": {name: [{k: v for k, v in run.items() if k != "tokens"} for run in done] for name, done in runs.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "verification.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, row in summary.items():
        print(f"{name:>8}: {row['tokens_per_s_median']:7.1f} tokens/s, overhead {100 * row['overhead']:+6.1f} %, "
              f"checks per run {row['checks_per_run']}, same tokens {row['same_tokens']}")


if __name__ == "__main__":
    main()
