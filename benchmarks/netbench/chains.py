"""Chains of servers side by side under one device budget: the benches that compare server layouts.

`offload_bench` (3 servers without KV offload against 2 with it) and `quant_netbench` (3 float32 servers against
fewer int8 or nf4 ones) give every server the same `--device-memory` and `--cache-tokens` = batch x max_length, start
all chains' servers together in one set of netbench namespaces (one server at a time: their start-up measurements),
and in each environment run the chains in turn, the order reversed every other round, through netbench's worker,
metrics and planner predictions. Here: the shared arguments, the rounds, each chain's figures beside the planner's,
the Markdown table and the plot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.netbench import cli, knobs, metrics, netns, predict, presets, report

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chain:
    key: str
    label: str
    ranges: tuple[tuple[int, int], ...]
    knob: str  # the knobs' name[:VALUE] that sets this chain's servers apart


def build_parser(prog: str, description: str, out_dir: Path, envs: str, device_memory: str | None,
                 memory_help: str = "every server's --device-memory") -> argparse.ArgumentParser:
    """The arguments every chains bench takes: model, budget, workload, environments, timeouts."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wide", help="netbench model name (default wide: 3 blocks, hidden 4096)")
    parser.add_argument("--device-memory", default=device_memory, help=memory_help)
    parser.add_argument("--host-memory", default="3GiB", help="every server's --host-memory")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=1024, help="the sessions' max_length (KV cache length)")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs per chain and environment, alternating order")
    parser.add_argument("--envs", default=envs)
    parser.add_argument("--config", default="baseline",
                        help="the other optimisations, the same for every chain (baseline: compression and "
                             "micro-batching off)")
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--out", default=str(out_dir))
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--run-timeout", type=float, default=1800.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--retry-wait", type=float, default=10.0)
    return parser


def start(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The parsed arguments (max_length at least the workload's), logging set up, root checked."""
    args = parser.parse_args(argv)
    args.max_length = max(args.max_length, args.prompt_len + args.new_tokens)
    cli.start_bench(parser.prog)
    return args


def configurations(base: str, chain_list: list[Chain], knob: str) -> dict[str, knobs.Configuration]:
    """Each chain's configuration: `base` (the other optimisations, the same for all) plus the chain's own knob."""
    if base in ("auto", "all", "best") or knob in base:
        raise SystemExit(f"--config: name the optimisations (baseline, compression, micro_batching:N, ...), "
                         f"without {knob} and without auto values")
    prefix = [] if base == "baseline" else [base]
    out = {chain.key: knobs.parse_configuration("+".join(prefix + [chain.knob])) for chain in chain_list}
    if any(config.bandwidth_sensitive for config in out.values()):
        raise SystemExit("--config: auto values make the servers depend on the link; give fixed values")
    return out


def server_flags(args, config: knobs.Configuration) -> list[str]:
    """A server's flags: the configuration's, the shared budget and the workload's batch and cache."""
    return [*config.server_args(), "--device-memory", args.device_memory, "--host-memory", args.host_memory,
            "--cache-tokens", str(args.batch * args.max_length), "--max-length", str(args.max_length),
            "--max-batch-size", str(args.batch)]


def run_chains(args, model_path: str, model_name: str, chain_list: list[Chain],
               configs: dict[str, knobs.Configuration], name: str) -> dict[str, Any]:
    """Every chain in every environment, side by side; per "environment/chain key" netbench's record."""
    from benchmarks.netbench.swarm import NetSwarm

    nodes = ["client"] + [f"s{i}" for i in range(max(len(chain.ranges) for chain in chain_list))]
    names = {configs[chain.key].name: [f"s{i}.{chain.key}" for i in range(len(chain.ranges))] for chain in chain_list}
    topology = netns.Topology(nodes)
    log_dir = Path(tempfile.mkdtemp(prefix=f"{name}-logs-"))
    previous = {sig: signal.signal(sig, cli._raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    swarm, records = None, {}
    try:
        topology.create()
        swarm = NetSwarm(topology, model_path, log_dir, startup_timeout=args.startup_timeout)
        worker = start_swarm(args, topology, swarm, model_path)
        for chain in chain_list:
            config = configs[chain.key]
            for server, blocks in zip(names[config.name], chain.ranges):
                swarm.start_server(server, server.split(".")[0], blocks, server_flags(args, config), "auto",
                                   cli.FIXED_ADVERTISED_MBPS, args.server_threads)
                cli._wait_online(worker, swarm, [server], args.startup_timeout)  # one at a time: start-up measurements
        background = cli.measure_background(topology, 5.0)
        meta = {"model": args.model, "model_name": model_name, "model_path": model_path, "dtype": "auto"}
        for env in presets.parse_environments(args.envs):
            topology.apply(env)
            for repeat in range(args.repeats):
                for chain in chain_list if repeat % 2 == 0 else list(reversed(chain_list)):
                    config = configs[chain.key]
                    rep = cli.run_with_retries(args, topology, swarm, worker, env, config, names, nodes)
                    record = records.setdefault((env.name, chain.key), cli.new_record(
                        args, env, config, nodes, topology, rep, names[config.name],
                        {**meta, "ranges": [list(r) for r in chain.ranges]}, background))
                    record["repeats"].append(rep["repeat"])
                    logger.info("%s %s: %.1f tok/s", env.name, chain.label,
                                metrics.summarize(record)["decode_tokens_per_s"])
    finally:
        if swarm is not None:
            swarm.stop()
        leftovers = topology.destroy()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logger.info("torn down; namespaces left behind: %s; logs in %s", leftovers or "none", log_dir)
    return {f"{env}/{key}": record for (env, key), record in records.items()}


def start_swarm(args, topology: netns.Topology, swarm, model_path: str):
    """The bootstrap peer and the client worker, joined; the worker."""
    swarm.start_dht()
    worker = swarm.start_worker(1)
    initial = swarm.wait_dht()
    worker.wait_ready(args.startup_timeout)
    worker.call("init", timeout=args.startup_timeout, model=model_path, initial_peers=initial,
                host_ip=topology.ips["client"], dtype="auto", threads=1)
    return worker


def measure(args, model_path: str, model_name: str, chain_list: list[Chain], knob: str, out: Path,
            name: str) -> list[dict[str, Any]]:
    """Run the chains (netbench's raw records into out/runs.json); each (environment, chain)'s `chain_result`."""
    configs = configurations(args.config, chain_list, knob)
    records = run_chains(args, model_path, model_name, chain_list, configs, name)
    (out / "runs.json").write_text(json.dumps(report.clean_json(records), indent=1))
    by_key = {chain.key: chain for chain in chain_list}
    return [chain_result(record, by_key[key.split("/")[1]], args.max_length) for key, record in records.items()]


def chain_result(record: dict, chain: Chain, max_length: int) -> dict[str, Any]:
    """netbench's figures of one run, what each server announced, and the planner's view of the session."""
    summary = cli.summarize(record)
    return {"env": record["env"]["name"], "chain": chain.key, "label": chain.label,
            "ranges": [list(r) for r in chain.ranges], "servers": [span["name"] for span in record["chain"]],
            "hops": len(record["hops"]), "alpha_announced": [span["offload"] for span in record["chain"]],
            "quant_announced": [span.get("quant_type") for span in record["chain"]],
            "planner_at_max_length": planner_view(record, max_length),
            "predicted_decode_tokens_per_s": predicted_tokens_per_s(summary), "summary": summary}


def planner_view(record: dict, context: int) -> dict[str, Any]:
    """The planner's alphas, precisions, weights and decode step for this chain with the session's whole KV cache
    (max_length tokens)."""
    from bloombee.planner.chain import chain_inputs
    from bloombee.planner.evaluate import evaluate

    chain = record["chain"]
    nodes = [{**span["profile"], "name": f"{span['name']}:{span['start']}"} for span in chain]
    hops = [rate or predict.UNSHAPED_MBPS for rate in record["hop_rates_mbps"]]
    assignment = [span["end"] - span["start"] for span in chain]
    batch = record["workload"]["batch"]
    inputs = chain_inputs(predict._model_section(record["model_path"]), nodes, hops, assignment, batch, context,
                          chain[0]["dtype"], record["client_settings"].get("compression", "auto"), hop_mbps=hops,
                          client_cpu=record["client_cpu"])
    evaluation = evaluate(inputs, assignment, batch, 1)
    return {"alphas": evaluation.alphas, "quant_types": evaluation.quant_types,
            "weight_bytes": [stage.weight_bytes for stage in evaluation.stages], "feasible": evaluation.feasible,
            "reason": evaluation.reason, "step_s": evaluation.step_time_s}


def predicted_tokens_per_s(summary: dict) -> float:
    """Decode tokens/s at the planner's simulated chain step plus the client's measured share of a step (embeddings
    and LM head); NaN without a prediction."""
    simulated = summary["predicted"].get("decode", {}).get("simulated_s")
    return summary["batch"] / (simulated + summary["head_median_s"]) if simulated else float("nan")


def speedups(rows: list[dict], key: str = "decode_tokens_per_s", reference: str = "a") -> dict[str, dict[str, float]]:
    """Per environment, each other chain's `key` (a summary figure) over the reference chain's, less one."""
    value = {(row["env"], row["chain"]): row["summary"][key] for row in rows}
    out: dict[str, dict[str, float]] = {}
    for (env, chain), figure in value.items():
        if chain != reference and (env, reference) in value:
            out.setdefault(env, {})[chain] = figure / value[(env, reference)] - 1
    return out


def base_meta(args, module: str, argv: list[str], model_name: str, chain_list: list[Chain]) -> dict[str, Any]:
    """What every chains bench's result records of its run: the command, the workload, the budget, the machine."""
    return {"command": "sudo unshare --net -- bash -c 'ip link set lo up && exec nice -n 10 .venv/bin/python -m "
                       f"{module} " + " ".join(shlex.quote(a) for a in argv) + "'",
            "model_name": model_name, "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "max_length": args.max_length, "device_memory": args.device_memory, "host_memory": args.host_memory,
            "config": args.config, "server_threads": args.server_threads,
            "chains": [{"key": c.key, "label": c.label, "ranges": c.ranges} for c in chain_list],
            "started": datetime.datetime.now().isoformat(timespec="seconds")}


def finish(out: Path, stem: str, result: dict, render: Callable[[dict], str], began: float) -> str:
    """The result's JSON (with the machine at the end and the run's seconds), its Markdown (`render`) and its plot
    into `out`; the Markdown."""
    result["meta"].update(machine=cli.machine_info(), seconds=round(time.monotonic() - began, 1))
    markdown = render(result)
    (out / f"{stem}.json").write_text(json.dumps(report.clean_json(result), indent=1))
    (out / f"{stem}.md").write_text(markdown)
    plot(result, out / f"{stem}.png")
    return markdown


# ---------------------------------------------------------------------------------- the table and the plot

Column = tuple[str, Callable[[dict], str]]


def mib(size: float) -> str:
    return f"{size / 2**20:.0f} MiB"


def describe(meta: dict) -> list[str]:
    """The command, then the workload, the budget and the machine in a sentence."""
    return [f"`{meta['command']}`", "",
            (f"Model {meta['model_name']}, B = {meta['batch']}, prompt {meta['prompt_len']}, {meta['new_tokens']} new "
             f"tokens, max_length {meta['max_length']}, `--device-memory {meta['device_memory']}` per server, "
             f"`--cache-tokens {meta['batch'] * meta['max_length']}`, other optimisations: `{meta['config']}`, "
             f"{meta['server_threads']} torch thread per server; {meta['machine']['cpus']} CPUs "
             f"({meta['machine'].get('cpu_capability', '?')} kernels), load average "
             f"{meta['machine']['loadavg_start']} at the end, git {meta['machine']['git']}.")]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _ratio(row: dict) -> str:
    """Measured over simulated decode chain step, flagged past 20 %."""
    pred = row["summary"]["predicted"].get("decode", {})
    ratio = pred["measured_s"] / pred["simulated_s"] if pred else float("nan")
    return f"{ratio:.2f}{' (> 20 % off)' if abs(ratio - 1) > 0.2 else ''}"


def _predicted(row: dict) -> str:
    pred = row["summary"]["predicted"].get("decode", {})
    return f"{_ms(pred.get('closed_form_s', float('nan')))} / {_ms(pred.get('simulated_s', float('nan')))}"


LEAD_COLUMNS: list[Column] = [("env", lambda row: row["env"]), ("chain", lambda row: row["label"]),
                              ("hops", lambda row: str(row["hops"]))]
STEP_COLUMNS: list[Column] = [
    ("decode tok/s", lambda row: f"{row['summary']['decode_tokens_per_s']:.2f}"),
    ("step median ms", lambda row: _ms(row["summary"]["step_median_s"])),
    ("chain median ms", lambda row: _ms(row["summary"]["chain_median_s"])),
    ("compute ms", lambda row: _ms(row["summary"]["compute_s"])),
    ("transport ms", lambda row: _ms(row["summary"]["transport_s"])),
    ("predicted chain ms (closed / sim)", _predicted),
    ("measured / predicted", _ratio),
]


def table(rows: list[dict], columns: list[Column]) -> list[str]:
    """A Markdown table of the chains' rows."""
    return ["| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns),
            *["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows]]


def plot(result: dict, path: Path) -> None:
    """Decode tokens/s per chain per environment and the chain step measured, each beside the planner's prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["chains"]
    envs = list(dict.fromkeys(row["env"] for row in rows))
    labels = list(dict.fromkeys(row["label"] for row in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        mine = {row["env"]: row for row in rows if row["label"] == label}
        xs = [e + (i - (len(labels) - 1) / 2) * width for e in range(len(envs))]
        summaries = [mine[env]["summary"] for env in envs]
        left.bar(xs, [s["decode_tokens_per_s"] for s in summaries], width, label=label)
        left.scatter(xs, [mine[env]["predicted_decode_tokens_per_s"] for env in envs], marker="_", s=400,
                     color="black", zorder=3, label="planner's prediction" if i == 0 else None)
        right.bar(xs, [s["chain_median_s"] * 1e3 for s in summaries], width, label=f"{label}: measured")
        right.scatter(xs, [s["predicted"].get("decode", {}).get("simulated_s", float("nan")) * 1e3 for s in summaries],
                      marker="_", s=400, color="black", zorder=3, label="planner's prediction" if i == 0 else None)
    for axis, title in ((left, "decode tokens/s"), (right, "decode chain step, ms")):
        axis.set_xticks(range(len(envs)), envs)
        axis.set_title(title)
        axis.legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"{meta['model_name']}, B={meta['batch']}, --device-memory {meta['device_memory']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
