"""Issue 12: under one device-memory budget, 3 servers without KV offload against 2 with the planner's alpha.

Every server gets the same `--device-memory` (enforced on this CPU as if the device were a GPU of that size)
and `--cache-tokens` = batch x max_length, so that `--offload auto` sizes the cache for this workload. The
budget is chosen so that one block and its cache fit without offload and two do not. Both chains run side by
side in one set of netbench namespaces (their servers alive together, runs alternating), through netbench's own
worker, metrics and planner predictions. Then, on loopback, the largest batch whose session a 2-block server
opens at that budget with `--offload 0`, `0.5` and `1`.

    sudo unshare --net -- bash -c 'ip link set lo up && exec nice -n 10 .venv/bin/python -m benchmarks.offload_bench'
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.netbench import cli, knobs, models, netns, predict, presets, report

logger = logging.getLogger("benchmarks.offload_bench")

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "benchmarks" / "results" / "offload"
BATCH_OFFLOADS = (0.0, 0.5, 1.0)


@dataclass(frozen=True)
class Chain:
    key: str
    label: str
    ranges: tuple[tuple[int, int], ...]
    offload: str  # the knobs' name:VALUE of the offload optimisation


def chains(num_blocks: int) -> list[Chain]:
    """One server per block without offload, against the first blocks on one server with the planner's alpha."""
    return [Chain("a", f"{num_blocks} servers, --offload 0", tuple((i, i + 1) for i in range(num_blocks)), "offload:0"),
            Chain("b", f"{num_blocks - 1} servers, --offload auto", ((0, num_blocks - 1), (num_blocks - 1, num_blocks)),
                  "offload")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offload_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wide", help="netbench model name (default wide: 3 blocks, hidden 4096)")
    parser.add_argument("--device-memory", default="1400MiB", help="every server's --device-memory")
    parser.add_argument("--host-memory", default="3GiB", help="every server's --host-memory")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=1024, help="the sessions' max_length (KV cache length)")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs per chain and environment, alternating order")
    parser.add_argument("--envs", default="E1,E5")
    parser.add_argument("--config", default="baseline",
                        help="the other optimisations, the same for both chains (baseline: compression and micro-batching off)")
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--probe-model", default="wide:2",
                        help="the batch-size probe's model: its server holds all of its blocks (wide:2: two blocks of wide)")
    parser.add_argument("--alloc-timeout", type=float, default=0.5, help="--alloc-timeout of the batch-size probes")
    parser.add_argument("--out", default=str(OUT_DIR))
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--run-timeout", type=float, default=1800.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--retry-wait", type=float, default=10.0)
    return parser


# ---------------------------------------------------------------------------------- the memory figures


def meta_backend(model_path: str, start: int, end: int):
    """A BlockBackend of blocks [start, end) on the meta device: the server's byte accounting without the weights."""
    import torch

    from bloombee.loading import load_model_config
    from bloombee.loading.weights import resolve_dtype
    from bloombee.models import family_for_config
    from bloombee.server.backend import BlockBackend

    config = load_model_config(model_path)
    dtype = resolve_dtype("auto", config)
    with torch.device("meta"):
        stack = family_for_config(config).block_stack(config, start, end).to(dtype)
    return BlockBackend(stack, torch.device("cpu"), dtype)


def expected_alpha(model_path: str, blocks: tuple[int, int], device_bytes: int, cache_tokens: int) -> dict[str, Any]:
    """What `--offload auto` gives a CPU server of `blocks` at this budget, by the server's own rule."""
    from bloombee.planner.costs import offload_fraction

    backend = meta_backend(model_path, *blocks)
    weights = backend.weight_bytes
    kv = backend.session_bytes(*blocks, 1, cache_tokens, offload=0.0).device
    room = device_bytes - weights
    heads = backend.stack.block_configs[0].num_kv_heads
    alpha = float(offload_fraction(room, kv, heads)) + 0.0 if room > 0 else None  # + 0.0: no -0.0
    return {"blocks": list(blocks), "weight_bytes": weights, "kv_bytes": kv, "room_bytes": room, "alpha": alpha}


def check_premise(figures: list[dict]) -> None:
    """The budget must force the choice: one block fits without offload, the first server of chain b needs it."""
    single, double = figures[0], figures[-1]
    if single["alpha"] != 0.0 or double["alpha"] is None or not 0.0 < double["alpha"] < 1.0:
        raise SystemExit(f"--device-memory does not force the choice (alpha 0 with one block, between 0 and 1 with "
                         f"two): {figures}")


# ---------------------------------------------------------------------------------- the chains over netns


def configurations(base: str) -> dict[str, knobs.Configuration]:
    """The two chains' configurations: `base` plus offload 0 (chain a) or auto (chain b)."""
    if base in ("auto", "all", "best") or "offload" in base:
        raise SystemExit("--config: name the optimisations (baseline, compression, micro_batching:N, ...), "
                         "without offload and without auto values")
    prefix = [] if base == "baseline" else [base]
    out = {chain.key: knobs.parse_configuration("+".join(prefix + [chain.offload])) for chain in chains(3)}
    if any(config.bandwidth_sensitive for config in out.values()):
        raise SystemExit("--config: auto values make the servers depend on the link; give fixed values")
    return out


def server_flags(args, config: knobs.Configuration) -> list[str]:
    return [*config.server_args(), "--device-memory", args.device_memory, "--host-memory", args.host_memory,
            "--cache-tokens", str(args.batch * args.max_length), "--max-length", str(args.max_length)]


def run_chains(args, model_path: str, model_name: str, chain_list: list[Chain]) -> dict[str, Any]:
    """Both chains in every environment, side by side; per (environment, chain) netbench's summary."""
    from benchmarks.netbench.swarm import NetSwarm

    configs = configurations(args.config)
    nodes = ["client"] + [f"s{i}" for i in range(max(len(chain.ranges) for chain in chain_list))]
    names = {configs[chain.key].name: [f"s{i}.{chain.key}" for i in range(len(chain.ranges))] for chain in chain_list}
    topology = netns.Topology(nodes)
    log_dir = Path(tempfile.mkdtemp(prefix="offload-bench-logs-"))
    previous = {sig: signal.signal(sig, cli._raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    swarm, records = None, {}
    try:
        topology.create()
        swarm = NetSwarm(topology, model_path, log_dir, startup_timeout=args.startup_timeout)
        swarm.start_dht()
        worker = swarm.start_worker(1)
        initial = swarm.wait_dht()
        worker.wait_ready(args.startup_timeout)
        worker.call("init", timeout=args.startup_timeout, model=model_path, initial_peers=initial,
                    host_ip=topology.ips["client"], dtype="auto", threads=1)
        for chain in chain_list:
            config = configs[chain.key]
            for name, blocks in zip(names[config.name], chain.ranges):
                swarm.start_server(name, name.split(".")[0], blocks, server_flags(args, config), "auto",
                                   cli.FIXED_ADVERTISED_MBPS, args.server_threads)
                cli._wait_online(worker, swarm, [name], args.startup_timeout)  # one at a time: start-up measurements
        background = cli.measure_background(topology, 5.0)
        for env in presets.parse_environments(args.envs):
            topology.apply(env)
            for repeat in range(args.repeats):
                for chain in chain_list if repeat % 2 == 0 else list(reversed(chain_list)):
                    config = configs[chain.key]
                    rep = cli.run_with_retries(args, topology, swarm, worker, env, config, names, nodes)
                    meta = {"model": args.model, "model_name": model_name, "model_path": model_path, "dtype": "auto",
                            "ranges": [list(r) for r in chain.ranges]}
                    record = records.setdefault((env.name, chain.key), cli.new_record(
                        args, env, config, nodes, topology, rep, names[config.name], meta, background))
                    record["repeats"].append(rep["repeat"])
                    logger.info("%s %s: %.1f tok/s", env.name, chain.label, cli.metrics.summarize(record)["decode_tokens_per_s"])
    finally:
        if swarm is not None:
            swarm.stop()
        leftovers = topology.destroy()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logger.info("torn down; namespaces left behind: %s; logs in %s", leftovers or "none", log_dir)
    return {f"{env}/{key}": record for (env, key), record in records.items()}


def chain_result(record: dict, chain: Chain, max_length: int) -> dict[str, Any]:
    """netbench's figures of one run, the alpha each server announced, and the planner's view of the session."""
    summary = cli.summarize(record)
    return {"env": record["env"]["name"], "chain": chain.key, "label": chain.label, "ranges": [list(r) for r in chain.ranges],
            "servers": [span["name"] for span in record["chain"]], "hops": len(record["hops"]),
            "alpha_announced": [span["offload"] for span in record["chain"]],
            "planner_at_max_length": planner_view(record, max_length), "summary": summary}


def planner_view(record: dict, context: int) -> dict[str, Any]:
    """The planner's alphas and decode step for this chain with the session's whole KV cache (max_length tokens)."""
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
    return {"alphas": evaluation.alphas, "feasible": evaluation.feasible, "reason": evaluation.reason,
            "step_s": evaluation.step_time_s}


# ---------------------------------------------------------------------------------- batch size at a budget


def start_loopback_server(args, model_path: str, offload: float, log_path: Path) -> tuple[subprocess.Popen, list[str]]:
    """A server of all of the model's blocks that starts its own swarm on loopback; its process and its address."""
    argv = [sys.executable, "-m", "bloombee.cli.server", "--new-swarm", "--model", model_path,
            "--device-memory", args.device_memory, "--host-memory", args.host_memory, "--offload", f"{offload:g}",
            "--alloc-timeout", f"{args.alloc_timeout:g}", "--max-batch-size", "100000", "--max-length",
            str(args.max_length), "--num-threads", str(args.server_threads), "--no-profile",
            "--public-name", f"probe-{offload:g}"]
    log = open(log_path, "w")
    popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, text=True)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        found = re.findall(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", log_path.read_text(errors="replace"))
        if found:
            return popen, found[:1]
        if popen.poll() is not None:
            break
        time.sleep(0.5)
    popen.kill()
    raise RuntimeError(f"the loopback server did not start; its log:\n{log_path.read_text(errors='replace')[-3000:]}")


def opens(model, max_length: int, batch: int) -> str | None:
    """None if a session of `batch` x `max_length` opens, else the server's refusal."""
    from bloombee.client.spans import RequestRejected

    for _ in range(3):
        try:
            model.remote.inference_session(max_length=max_length, batch_size=batch).close()
            return None
        except RequestRejected as error:
            refusal = str(error)
        if "in all" in refusal:  # over the whole budget; otherwise the last probe's memory was not back yet
            break
        time.sleep(1.0)
    return refusal


def largest_batch(model, max_length: int) -> tuple[int, str]:
    """The largest batch that opens (doubling, then bisection) and the refusal of the one above it."""
    low, high, refusal = 0, 1, None
    while (refusal := opens(model, max_length, high)) is None:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        answer = opens(model, max_length, middle)
        low, high, refusal = (middle, high, refusal) if answer is None else (low, middle, answer)
    return low, refusal


def wait_for_server(model, max_length: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            opens(model, max_length, 1)
            return
        except Exception as error:  # not announced yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"the loopback server is not usable: {error}") from error
            logger.info("waiting for the loopback server: %s", error)
            time.sleep(1.0)


def batch_table(args) -> list[dict[str, Any]]:
    """The largest batch whose session opens at the budget, per --offload, beside the budget arithmetic."""
    import torch

    from bloombee.client import AutoDistributedModel
    from bloombee.loading import load_model_config
    from bloombee.server.memory import parse_bytes

    model_path = models.resolve(args.probe_model)[0]
    blocks = load_model_config(model_path).num_hidden_layers
    backend = meta_backend(model_path, 0, blocks)
    weights = backend.weight_bytes
    room, host = parse_bytes(args.device_memory) - weights, parse_bytes(args.host_memory)
    rows = []
    for offload in BATCH_OFFLOADS:
        one = backend.session_bytes(0, blocks, 1, args.max_length, offload=offload)
        expected = min(room // one.device if one.device else host // one.host, host // one.host)
        log_path = Path(tempfile.mkstemp(prefix=f"offload-probe-{offload:g}-", suffix=".log")[1])
        popen, peers = start_loopback_server(args, model_path, offload, log_path)
        try:
            with AutoDistributedModel.from_pretrained(model_path, initial_peers=peers, dtype=torch.float32,
                                                      allowed_servers=[f"probe-{offload:g}"]) as model:
                wait_for_server(model, args.max_length, args.startup_timeout)
                measured, refusal = largest_batch(model, args.max_length)
        finally:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                logger.warning("the loopback server did not stop on SIGTERM; killing its process group")
                os.killpg(popen.pid, signal.SIGKILL)
        rows.append({"offload": offload, "max_batch": measured, "expected_max_batch": int(expected),
                     "per_row_device_bytes": one.device, "per_row_host_bytes": one.host, "refusal": refusal})
        logger.info("--offload %g: largest batch %d (budget arithmetic %d)", offload, measured, expected)
    return rows


# ---------------------------------------------------------------------------------- outputs


def mib(size: float) -> str:
    return f"{size / 2**20:.0f} MiB"


def markdown(result: dict) -> str:
    """The summary page: the premise, both chains per environment with the predictions, the batch table."""
    meta = result["meta"]
    lines = [f"# KV offload: {len(meta['chains'][0]['ranges'])} servers without offload vs "
             f"{len(meta['chains'][1]['ranges'])} with the planner's alpha", "",
             f"`{meta['command']}`", "",
             f"Model {meta['model_name']}, B = {meta['batch']}, prompt {meta['prompt_len']}, {meta['new_tokens']} new tokens, "
             f"max_length {meta['max_length']}, `--device-memory {meta['device_memory']}` per server, "
             f"`--cache-tokens {meta['batch'] * meta['max_length']}`, other optimisations: `{meta['config']}`, "
             f"{meta['server_threads']} torch thread per server; {meta['machine']['cpus']} CPUs, load average "
             f"{meta['machine']['loadavg_start']} at the end, git {meta['machine']['git']}.", "",
             "| server blocks | weights | room for sessions | KV of --cache-tokens | alpha (auto, expected) |", "|---|---|---|---|---|"]
    for fig in meta["memory"]:
        lines.append(f"| {fig['blocks'][0]}:{fig['blocks'][1]} | {mib(fig['weight_bytes'])} | {mib(fig['room_bytes'])} | "
                     f"{mib(fig['kv_bytes'])} | {fig['alpha']} |")
    lines += ["", "| env | chain | hops | alpha announced | planner alpha (at max_length) | decode tok/s | step median ms | "
              "chain median ms | compute ms | transport ms | predicted chain ms (closed / sim) | measured / predicted |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["chains"]:
        s, pred = row["summary"], row["summary"]["predicted"].get("decode", {})
        ratio = pred["measured_s"] / pred["simulated_s"] if pred else float("nan")
        lines.append(f"| {row['env']} | {row['label']} | {row['hops']} | {row['alpha_announced']} | "
                     f"{row['planner_at_max_length']['alphas']} | {s['decode_tokens_per_s']:.2f} | {s['step_median_s'] * 1e3:.0f} | "
                     f"{s['chain_median_s'] * 1e3:.0f} | {s['compute_s'] * 1e3:.0f} | {s['transport_s'] * 1e3:.0f} | "
                     f"{pred.get('closed_form_s', float('nan')) * 1e3:.0f} / {pred.get('simulated_s', float('nan')) * 1e3:.0f} | "
                     f"{ratio:.2f}{' (> 20 % off)' if abs(ratio - 1) > 0.2 else ''} |")
    lines += [""] + [f"- {env}: the 2-server chain's decode tokens/s is {speedup:+.1%} against the 3-server chain's"
                     for env, speedup in result["speedup"].items()]
    lines += ["", f"Largest batch whose session opens on one server of all blocks of {meta['probe_model']} at "
              f"`--device-memory {meta['device_memory']}` "
              f"`--host-memory {meta['host_memory']}`, max_length {meta['max_length']}:", "",
              "| --offload | largest batch | budget arithmetic | device / host bytes per row | refusal one above |", "|---|---|---|---|---|"]
    for row in result["batches"]:
        lines.append(f"| {row['offload']:g} | {row['max_batch']} | {row['expected_max_batch']} | "
                     f"{mib(row['per_row_device_bytes'])} / {mib(row['per_row_host_bytes'])} | {row['refusal']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """tokens/s per chain per environment, and the chain step measured beside the planner's prediction."""
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
        left.bar(xs, [mine[env]["summary"]["decode_tokens_per_s"] for env in envs], width, label=label)
        measured = [mine[env]["summary"]["chain_median_s"] * 1e3 for env in envs]
        predicted = [mine[env]["summary"]["predicted"].get("decode", {}).get("simulated_s", float("nan")) * 1e3 for env in envs]
        right.bar(xs, measured, width, label=f"{label}: measured")
        right.scatter(xs, predicted, marker="_", s=400, color="black", zorder=3,
                      label="planner's prediction" if i == 0 else None)
    for axis, title in ((left, "decode tokens/s"), (right, "decode chain step, ms")):
        axis.set_xticks(range(len(envs)), envs)
        axis.set_title(title)
        axis.legend(fontsize=8)
    fig.suptitle(f"{result['meta']['model_name']}, B={result['meta']['batch']}, --device-memory {result['meta']['device_memory']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.max_length = max(args.max_length, args.prompt_len + args.new_tokens)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    reason = cli.check_privileges()
    if reason:
        raise SystemExit(f"offload_bench {reason}")
    from bloombee.loading import load_model_config
    from bloombee.server.memory import parse_bytes

    model_path, model_name, _ = models.resolve(args.model)
    chain_list = chains(load_model_config(model_path).num_hidden_layers)
    budget, cache_tokens = parse_bytes(args.device_memory), args.batch * args.max_length
    memory = [expected_alpha(model_path, blocks, budget, cache_tokens) for blocks in ((0, 1), chain_list[1].ranges[0])]
    check_premise(memory)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began, started = time.monotonic(), datetime.datetime.now().isoformat(timespec="seconds")
    batches = batch_table(args)
    records = run_chains(args, model_path, model_name, chain_list)
    (out / "runs.json").write_text(json.dumps(report.clean_json(records), indent=1))
    by_key = {chain.key: chain for chain in chain_list}
    rows = [chain_result(record, by_key[key.split("/")[1]], args.max_length) for key, record in records.items()]
    for row in rows:
        if row["chain"] == "b" and row["alpha_announced"][0] != memory[-1]["alpha"]:
            logger.warning("chain b's first server announced alpha %s, the rule gives %s", row["alpha_announced"][0],
                           memory[-1]["alpha"])
    tps = {(row["env"], row["chain"]): row["summary"]["decode_tokens_per_s"] for row in rows}
    speedup = {env: tps[(env, "b")] / tps[(env, "a")] - 1 for env, key in tps if key == "a" and (env, "b") in tps}
    meta = {"command": "sudo unshare --net -- bash -c 'ip link set lo up && exec nice -n 10 .venv/bin/python -m "
                       "benchmarks.offload_bench " + " ".join(shlex.quote(a) for a in argv) + "'",
            "model_name": model_name, "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "max_length": args.max_length, "device_memory": args.device_memory, "host_memory": args.host_memory,
            "config": args.config, "probe_model": args.probe_model, "server_threads": args.server_threads, "memory": memory,
            "chains": [{"key": c.key, "label": c.label, "ranges": c.ranges} for c in chain_list],
            "machine": cli.machine_info(), "started": started,
            "seconds": round(time.monotonic() - began, 1)}
    result = {"meta": meta, "chains": rows, "speedup": speedup, "batches": batches}
    (out / "offload.json").write_text(json.dumps(report.clean_json(result), indent=1))
    (out / "offload.md").write_text(markdown(result))
    plot(result, out / "offload.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
