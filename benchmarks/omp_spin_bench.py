"""CPU a client and a server burn while one session decodes: libgomp's default spin against BloomBee's bound.

After each parallel operation, torch's OpenMP worker threads (GNU libgomp, in torch's Linux wheels) spin
GOMP_SPINCOUNT turns (300,000 by default) before they sleep. Between two decode steps a client waits for the swarm
and a server for the next step, so each keeps a core spinning for nothing. `import bloombee` bounds the spin
(`bloombee.OMP_SPIN_TURNS`) unless the user chose a wait policy. Side by side, `--repeats` times in turn, each
configuration in processes of its own (libgomp reads its environment once): one server holding every block and one
client, both at torch's default threads (one per core), one session of `--steps` greedy decode steps at a time. Per
configuration: the decode step's median, the client's and the server's CPU while decoding, in cores, and the local
transformers model's decode step in the client's process.

    python -m benchmarks.omp_spin_bench
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CONFIGS = {"libgomp default": "300000", "bloombee": None}  # GOMP_SPINCOUNT: libgomp's own default, or ours
PROMPT = 16
KEYS = ("step_ms", "client_cores", "server_cores", "local_step_ms")


def measure(steps: int, sessions: int) -> dict:
    """In this process: a one-server swarm and `sessions` sessions one after another; step times and CPU."""
    from bloombee.client import AutoDistributedModel  # before torch, which loads libgomp
    from bloombee.loading import dht_prefix, load_model_config, resolve_model
    from bloombee.local_swarm import LocalSwarm

    import torch

    path = resolve_model("bloombee-tiny")
    num_blocks = load_model_config(path).num_hidden_layers
    with LocalSwarm(str(path), num_blocks, dht_prefix(path), server_threads=0) as swarm:
        server = swarm.add_server("--blocks", f"0:{num_blocks}")
        with AutoDistributedModel.from_pretrained(str(path), initial_peers=swarm.initial_peers) as model:
            model.remote.manager.update(force=True)
            prompt = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
            decode_session(model, prompt, steps, server.process.pid)  # warms both sides up
            runs = [decode_session(model, prompt, steps, server.process.pid) for _ in range(sessions)]
    wall = sum(run["wall"] for run in runs)
    return {"step_ms": 1e3 * statistics.median(step for run in runs for step in run["steps"]),
            "client_cores": sum(run["client_cpu"] for run in runs) / wall,
            "server_cores": sum(run["server_cpu"] for run in runs) / wall, "local_step_ms": local_step_ms(path, steps),
            "torch_threads": torch.get_num_threads(), "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}


def decode_session(model, prompt, steps: int, server_pid: int) -> dict:
    """One session: the prompt, then `steps` greedy decode steps, timed, with this process's and the server's CPU."""
    import torch

    from bloombee.host_costs import processes_cpu_s

    with torch.inference_mode(), model.remote.inference_session(max_length=PROMPT + steps + 1) as session:
        token = model.head.logits(session.step(model.head.embed(prompt)))[:, -1:].argmax(-1)
        began, client_began, server_began = time.perf_counter(), time.process_time(), processes_cpu_s([server_pid])
        times = []
        for _ in range(steps):
            step_began = time.perf_counter()
            token = model.head.logits(session.step(model.head.embed(token)))[:, -1:].argmax(-1)
            times.append(time.perf_counter() - step_began)
        return {"steps": times, "wall": time.perf_counter() - began, "client_cpu": time.process_time() - client_began,
                "server_cpu": processes_cpu_s([server_pid]) - server_began}


def local_step_ms(path, steps: int, rounds: int = 5) -> float:
    """The local transformers model's decode step in this process, with nothing else running (what back-to-back
    operations cost under each spin): the best of `rounds` medians of `steps` steps, as this machine drifts."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    medians = []
    with torch.inference_mode():
        for _ in range(rounds):
            out, times = model(ids, use_cache=True), []
            for _ in range(steps):
                token = out.logits[:, -1:].argmax(-1)
                began = time.perf_counter()
                out = model(token, past_key_values=out.past_key_values, use_cache=True)
                times.append(time.perf_counter() - began)
            medians.append(statistics.median(times))
    return 1e3 * min(medians)


def run_config(spin: str | None, steps: int, sessions: int) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    out = subprocess.run([sys.executable, "-m", "benchmarks.omp_spin_bench", "--child", "--steps", str(steps),
                          "--sessions", str(sessions)], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per session")
    parser.add_argument("--sessions", type=int, default=4, help="sessions per run, one after another")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(RESULTS / "omp_spin.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps, args.sessions)))
        return
    runs = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name, spin in CONFIGS.items():
            runs[name].append(run_config(spin, args.steps, args.sessions))
            print(name, runs[name][-1], flush=True)
    rows = [{"config": name, "gomp_spincount": results[0]["gomp_spincount"],
             **{key: statistics.median(run[key] for run in results) for key in KEYS},
             "runs": results} for name, results in runs.items()]
    print("| spin | decode step ms | client cores | server cores | local model's step ms |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['step_ms']:.2f} | {row['client_cores']:.2f} | {row['server_cores']:.2f} | "
              f"{row['local_step_ms']:.2f} |")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"steps": args.steps, "sessions": args.sessions, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
