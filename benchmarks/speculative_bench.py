"""Issue 13: tree speculative decoding on bloombee-tiny and its draft, through 2 servers in netbench's namespaces.

Side by side in every environment (E1 unshaped, E3 250 Mbit/s, E5 20 Mbit/s by default), greedy, on
held-out prompts of the tiny pair's corpus: plain decoding (netbench's `baseline`), speculation
unpruned, pruned at several thresholds, and the product's switch (`speculative:auto`). For each:
end-to-end tokens/s, tokens committed per row per round, tree nodes each hop carried, and at a larger
batch each request's completion time (the paper's figure 12). Every speculative output is checked
against the plain output token for token. Servers advertise the environment's rate, as the switch
reads it.

    sudo unshare --net -- bash -c 'ip link set lo up && exec nice -n 10 .venv/bin/python -m benchmarks.speculative_bench'
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.netbench import cli, knobs, netns, presets, report

logger = logging.getLogger("benchmarks.speculative_bench")

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "benchmarks" / "results" / "speculative"
RANGES = ((0, 4), (4, 8))
UNSHAPED_ADVERTISED_MBPS = 10000.0


def variants(taus: list[float]) -> list[dict[str, Any]]:
    """(name, netbench configuration, generate() arguments) of every compared variant."""
    result = [{"name": "plain", "config": "baseline", "generate": {}},
              {"name": "SD unpruned", "config": "speculative", "generate": {"prune_tau": 0.0}}]
    result += [{"name": f"SD tau {tau:g}", "config": "speculative", "generate": {"prune_tau": tau}} for tau in taus]
    result.append({"name": "SD auto", "config": "speculative:auto", "generate": {}})
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="E1,E3,E5")
    parser.add_argument("--taus", default="0.1,0.2,0.3", help="pruning thresholds compared")
    parser.add_argument("--widths", default="2,2,1,1", help="the draft tree's children per node at each depth")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts, each generated at batch 1")
    parser.add_argument("--completion-batch", type=int, default=8, help="batch of the completion-time runs")
    parser.add_argument("--repeats", type=int, default=3, help="runs per prompt, variant and environment")
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--out", default=str(OUT_DIR))
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--run-timeout", type=float, default=600.0)
    return parser


def run_env(args, env: presets.Environment, runs: list[dict], log_dir: Path) -> None:
    """Start the swarm for `env`, then every variant on every prompt, alternating the order per repeat."""
    from benchmarks.netbench.swarm import NetSwarm

    nodes = ["client", "s0", "s1"]
    topology = netns.Topology(nodes)
    swarm = None
    try:
        topology.create()
        swarm = NetSwarm(topology, "bloombee-tiny", log_dir / env.name, startup_timeout=args.startup_timeout)
        swarm.start_dht()
        worker = swarm.start_worker(1)
        initial = swarm.wait_dht()
        worker.wait_ready(args.startup_timeout)
        worker.call("init", timeout=args.startup_timeout, model="bloombee-tiny", initial_peers=initial,
                    host_ip=topology.ips["client"], dtype="float32", threads=1)
        names = [f"{node}.{env.name}" for node in nodes[1:]]
        for name, node, blocks in zip(names, nodes[1:], RANGES):
            swarm.start_server(name, node, blocks, [], "float32", env.advertised_mbps(node, nodes, UNSHAPED_ADVERTISED_MBPS),
                               args.server_threads)
            cli._wait_online(worker, swarm, [name], args.startup_timeout)
        topology.apply(env)
        client_mbps = env.advertised_mbps("client", nodes, UNSHAPED_ADVERTISED_MBPS)
        widths = [int(width) for width in args.widths.split(",")]
        taus = [float(tau) for tau in args.taus.split(",")]
        cases = [(1, seed) for seed in range(args.prompts)] + [(args.completion_batch, args.prompts)]
        for variant in variants(taus):  # a pass not recorded: the first runs after start-up are slower
            settings = {**knobs.parse_configuration(variant["config"]).client_settings(), "link_bandwidth_mbps": client_mbps}
            worker.call("speculate", timeout=args.run_timeout, allowed=names, settings=settings, batch=1,
                        prompt_len=args.prompt_len, new_tokens=args.new_tokens, seed=0,
                        generate={"draft_widths": widths, **variant["generate"]})
        for repeat in range(args.repeats):
            order = variants(taus) if repeat % 2 == 0 else list(reversed(variants(taus)))
            for batch, seed in cases:
                for variant in order:
                    config = knobs.parse_configuration(variant["config"])
                    settings = {**config.client_settings(), "link_bandwidth_mbps": client_mbps}
                    result = worker.call("speculate", timeout=args.run_timeout, allowed=names, settings=settings,
                                         batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                         seed=seed, generate={"draft_widths": widths, **variant["generate"]})
                    runs.append({"env": env.name, "variant": variant["name"], "batch": batch, "seed": seed,
                                 "repeat": repeat, **result})
                    logger.info("%s %s batch %d prompt %d: %.1f tok/s", env.name, variant["name"], batch, seed,
                                result["new_tokens"] / result["wall_s"])
    finally:
        if swarm is not None:
            swarm.stop()
        topology.destroy()


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(runs: list[dict]) -> list[dict[str, Any]]:
    """Per environment and variant at batch 1: tokens/s (total tokens over total time), tokens per round, nodes per
    hop, and whether every output equals plain decoding's."""
    plain = {(run["env"], run["batch"], run["seed"]): run["output"] for run in runs if run["variant"] == "plain"}
    rows = []
    for env in dict.fromkeys(run["env"] for run in runs):
        for variant in dict.fromkeys(run["variant"] for run in runs):
            mine = [run for run in runs if run["env"] == env and run["variant"] == variant and run["batch"] == 1]
            hops = [hop for run in mine for hop in run.get("nodes_per_hop", [])]
            rows.append({
                "env": env, "variant": variant, "runs": len(mine),
                "tokens_per_s": sum(run["new_tokens"] for run in mine) / sum(run["wall_s"] for run in mine),
                "tree_rounds": sum(run.get("tree_rounds", 0) for run in mine),
                "plain_rounds": sum(run.get("plain_rounds", 0) for run in mine),
                "accepted_per_round": mean([a for run in mine for a in run.get("accepted", [])]),
                "nodes_proposed": mean([n for run in mine for n in run.get("nodes_proposed", [])]),
                "nodes_per_hop": [mean([hop[i] for hop in hops]) for i in range(len(RANGES))] if hops else None,
                "exact": all(run["output"] == plain[(run["env"], run["batch"], run["seed"])]
                             for run in runs if run["env"] == env and run["variant"] == variant)})
    for row in rows:
        base = next(r for r in rows if r["env"] == row["env"] and r["variant"] == "plain")
        unpruned = next(r for r in rows if r["env"] == row["env"] and r["variant"] == "SD unpruned")
        row["speedup_vs_plain"] = row["tokens_per_s"] / base["tokens_per_s"]
        if row["variant"].startswith("SD tau") and row["nodes_per_hop"] and unpruned["nodes_per_hop"]:
            row["nodes_after_first_vs_unpruned"] = row["nodes_per_hop"][0] / unpruned["nodes_per_hop"][0]
            row["accepted_vs_unpruned"] = row["accepted_per_round"] / unpruned["accepted_per_round"]
    return rows


def completion_times(runs: list[dict], batch: int) -> dict[str, dict[str, list[float]]]:
    """Each request's completion time (s) per environment and variant in the batch runs (plain: all at the end)."""
    result: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        if run["batch"] != batch:
            continue
        times = run.get("completed_at") or [run["wall_s"]] * batch
        result.setdefault(run["env"], {}).setdefault(run["variant"], []).extend(times)
    return result


def markdown(rows: list[dict], completions: dict, batch: int) -> str:
    lines = ["| env | variant | tokens/s | vs plain | tokens/round | nodes sent (client, after server 1) | "
             "nodes vs unpruned | accepted vs unpruned | exact |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        hops = row["nodes_per_hop"]
        sent = f"{row['nodes_proposed']:.1f}, {hops[0]:.1f}" if hops else "-"
        lines.append(f"| {row['env']} | {row['variant']} | {row['tokens_per_s']:.1f} | {row['speedup_vs_plain']:.3f} | "
                     f"{row['accepted_per_round'] or 1:.2f} | {sent} | "
                     f"{row.get('nodes_after_first_vs_unpruned', float('nan')):.2f} | "
                     f"{row.get('accepted_vs_unpruned', float('nan')):.3f} | {row['exact']} |")
    lines += ["", f"Median completion time (s) of each request of a batch of {batch}:", "",
              "| env | " + " | ".join(next(iter(completions.values()))) + " |",
              "|---|" + "---|" * len(next(iter(completions.values())))]
    for env, by_variant in completions.items():
        lines.append(f"| {env} | " + " | ".join(f"{statistics.median(times):.2f}" for times in by_variant.values()) + " |")
    return "\n".join(lines) + "\n"


def plot(completions: dict, batch: int, path: Path) -> None:
    """The paper's figure 12: the spread of per-request completion times, per environment and variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(completions), figsize=(5 * len(completions), 3.6), squeeze=False)
    for axis, (env, by_variant) in zip(axes[0], completions.items()):
        for index, (variant, times) in enumerate(by_variant.items()):
            axis.scatter(times, [index] * len(times), s=14, alpha=0.6)
            axis.plot([statistics.median(times)] * 2, [index - 0.3, index + 0.3], color="black")
        axis.set_yticks(range(len(by_variant)), list(by_variant))
        axis.set_xlabel("completion time (s)")
        axis.set_title(f"{env}: requests of a batch of {batch}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    cli.start_bench("speculative_bench")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="speculative-bench-logs-"))
    previous = {sig: signal.signal(sig, cli._raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    began, started, runs = time.monotonic(), datetime.datetime.now().isoformat(timespec="seconds"), []
    try:
        for env in presets.parse_environments(args.envs):
            run_env(args, env, runs, log_dir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    rows, completions = summarize(runs), completion_times(runs, args.completion_batch)
    meta = {"command": "sudo unshare --net -- bash -c 'ip link set lo up && exec nice -n 10 .venv/bin/python -m "
                       "benchmarks.speculative_bench " + " ".join(shlex.quote(a) for a in argv) + "'",
            "args": vars(args), "ranges": RANGES, "machine": cli.machine_info(), "started": started,
            "seconds": round(time.monotonic() - began, 1), "logs": str(log_dir)}
    result = {"meta": meta, "summary": rows, "completion_s": completions}
    (out / "runs.json").write_text(json.dumps(report.clean_json(runs), indent=1))
    (out / "speculative.json").write_text(json.dumps(report.clean_json(result), indent=1))
    text = markdown(rows, completions, args.completion_batch)
    (out / "speculative.md").write_text(text)
    plot(completions, args.completion_batch, out / "completion_times.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
