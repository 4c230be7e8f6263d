"""`python -m benchmarks.netbench`: sweeps over environments x configurations, presets, cleanup, reports.

    sudo .venv/bin/python -m benchmarks.netbench sweep --model bloombee-tiny --servers 3 --batch 32 \\
        --envs E1,E2,E3,E4,E5 --configs baseline,compression --out benchmarks/results/netbench/tiny
    .venv/bin/python -m benchmarks.netbench presets
    sudo .venv/bin/python -m benchmarks.netbench cleanup        # namespaces of harness runs that died
    .venv/bin/python -m benchmarks.netbench report DIR          # tables and plots again from DIR/runs/*.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.netbench import knobs, metrics, netns, predict, presets, report
from benchmarks.netbench.plan import resolve_plan
from bloombee.progress import progress_bar

logger = logging.getLogger("benchmarks.netbench")

ROOT = Path(__file__).resolve().parents[2]
UNSHAPED_ADVERTISED_MBPS = 10000.0  # what nodes advertise (--link-bandwidth-mbps) on unshaped links
FIXED_ADVERTISED_MBPS = 1000.0  # advertised when the configuration does not depend on it (servers kept across environments)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    sweep = commands.add_parser("sweep", help="run every configuration in every environment (root)")
    sweep.add_argument("--model", default="bloombee-tiny",
                       help="bloombee-tiny, wide (random Llama, hidden 4096; wide:L for L blocks), pipeline (hidden 2048, 6 "
                            "blocks), hop-bound (hidden 2048, MLP 512, 3 blocks: one per server, hops far dearer than "
                            "blocks), or a model folder / hub id / alias")
    servers = sweep.add_mutually_exclusive_group()
    servers.add_argument("--servers", type=positive_int, default=None, help="split the blocks evenly over N servers (default 3)")
    servers.add_argument("--blocks", help="explicit ranges, one server each: 0:3,3:6,6:8")
    servers.add_argument("--plan", help="plan file: {'servers': [{'blocks': '0:3'}, ...]} or bloombee-plan --json output")
    sweep.add_argument("--batch", type=positive_int, default=32)
    sweep.add_argument("--prompt-len", type=positive_int, default=16)
    sweep.add_argument("--new-tokens", type=int, default=32, help="tokens generated: 1 prefill step + N-1 decode steps (N >= 2)")
    sweep.add_argument("--max-length", type=int, default=0,
                       help="the sessions' max_length, i.e. KV cache length (0: prompt + new tokens)")
    sweep.add_argument("--warmup-steps", type=int, default=2, help="decode steps of the warm-up session before each run")
    sweep.add_argument("--warmup-round-tokens", type=int, default=3,
                       help="a round before the measured ones in each environment: every configuration generates this many "
                            "tokens of the full prompt, unrecorded (the first full-size steps on new servers and links are "
                            "slow: up to 5x here); 0 = none")
    sweep.add_argument("--envs", default="E1,E2,E3,E4,E5",
                       help=f"comma-separated: {', '.join(presets.PRESETS)}, custom:RATE (e.g. custom:50mbit), matrix:FILE, "
                            "'uniform' (E1-E5) or 'all'")
    sweep.add_argument("--configs", default="baseline,compression",
                       help=f"comma-separated: baseline, all, auto, or optimisations joined by '+' ({', '.join(knobs.OPTIMISATIONS)})")
    sweep.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="servers' and client's dtype (auto: the checkpoint's)")
    sweep.add_argument("--server-threads", type=int, default=0,
                       help="torch threads per server (0: 1 for hidden <= 1024, else the CPU count)")
    sweep.add_argument("--client-threads", type=int, default=1)
    sweep.add_argument("--seed", type=int, default=0)
    sweep.add_argument("--repeats", type=positive_int, default=1,
                       help="runs per (environment, configuration); configurations alternate order between repeats")
    sweep.add_argument("--out", help="output folder (default benchmarks/results/netbench/<model>-b<B>-s<servers>)")
    sweep.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the swarm to come up")
    sweep.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run may take")
    sweep.add_argument("--request-timeout", type=float, default=600.0, help="the client's request_timeout (one step through the chain)")
    sweep.add_argument("--background-s", type=float, default=5.0,
                       help="seconds of idle swarm traffic measured after the servers come up (subtracted from interface bytes)")
    sweep.add_argument("--retries", type=int, default=2, help="attempts again a run whose client step failed")
    sweep.add_argument("--retry-wait", type=float, default=10.0, help="seconds before such a retry (bans expire)")
    sweep.add_argument("--no-plots", action="store_true")
    sweep.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (kept anyway when something is left behind)")
    sweep.add_argument("-v", "--verbose", action="store_true")

    commands.add_parser("presets", help="list the environments")
    cleanup = commands.add_parser("cleanup", help="delete namespaces (and their processes) left by harness runs that died")
    cleanup.add_argument("--all", action="store_true", help="also those of runs still alive")
    rep = commands.add_parser("report", help="summary table and plots again from DIR/runs/*.json")
    rep.add_argument("dir")
    return parser


# ---------------------------------------------------------------------------------- helpers


def check_privileges() -> str | None:
    """Why the harness cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} on PATH"
    return None


def start_bench(prog: str) -> None:
    """A bench's logging (INFO; hivemind and asyncio only warnings) and its root check: SystemExit naming what is
    missing."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    reason = check_privileges()
    if reason:
        raise SystemExit(f"{prog} {reason}")


def machine_info() -> dict[str, Any]:
    try:
        git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], check=False,
                               capture_output=True, text=True).stdout.strip()
        git = f"{git}{'+dirty' if dirty else ''}"
    except OSError:
        git = "?"
    import torch

    return {"cpus": os.cpu_count(), "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "kernel": platform.release(), "python": platform.python_version(), "git": git,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def default_threads(hidden: int) -> int:
    return 1 if hidden <= 1024 else (os.cpu_count() or 1)


class Interrupted(BaseException):
    pass


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


# ---------------------------------------------------------------------------------- the sweep


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Build the namespaces, run every (configuration, environment), tear down; returns the summaries."""
    from benchmarks.netbench import models
    from benchmarks.netbench.swarm import NetSwarm

    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (one prefill step plus at least one decode step)")
    reason = check_privileges()
    if reason:
        raise SystemExit(f"netbench sweep {reason}")
    envs = presets.parse_environments(args.envs)
    configs = knobs.parse_configurations(args.configs)
    model_path, model_name, model_note = models.resolve(args.model)
    from bloombee.loading import load_model_config

    model_config = load_model_config(model_path)
    ranges = resolve_plan(model_config.num_hidden_layers, args.servers, args.blocks, args.plan)
    server_nodes = [f"s{index}" for index in range(len(ranges))]
    nodes = ["client"] + server_nodes
    out_dir = Path(args.out or ROOT / "benchmarks" / "results" / "netbench" / f"{model_name}-b{args.batch}-s{len(ranges)}")
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    server_threads = args.server_threads or default_threads(model_config.hidden_size)
    meta = {
        "command": "sudo .venv/bin/python -m benchmarks.netbench " + " ".join(shlex.quote(a) for a in args.argv),
        "model": args.model, "model_path": model_path, "model_name": model_name, "model_note": model_note,
        "hidden_size": model_config.hidden_size, "num_blocks": model_config.num_hidden_layers, "dtype": args.dtype,
        "ranges": ranges, "server_nodes": server_nodes, "batch": args.batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "max_length": args.max_length, "warmup_steps": args.warmup_steps,
        "warmup_round_tokens": args.warmup_round_tokens, "envs": [env.to_dict() for env in envs],
        "configs": [config.to_dict() for config in configs], "server_threads": server_threads,
        "client_threads": args.client_threads, "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(), "repeats": args.repeats,
    }
    removed = netns.cleanup_stale()
    if removed:
        logger.warning("removed namespaces of dead harness runs: %s", removed)

    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    topology = netns.Topology(nodes)
    log_dir = Path(tempfile.mkdtemp(prefix="netbench-logs-"))
    records: dict[tuple[str, str], dict] = {}
    swarm = None
    began = time.monotonic()
    try:
        topology.create()
        swarm = NetSwarm(topology, model_path, log_dir, startup_timeout=args.startup_timeout,
                         env={"NETBENCH_LOG_LEVEL": "DEBUG" if args.verbose else "INFO"})
        swarm.start_dht()
        worker = swarm.start_worker(args.client_threads)
        initial_peers = swarm.wait_dht()
        logger.info("bootstrap peer up after %.1f s: %s", time.monotonic() - began, initial_peers[0])
        worker.wait_ready(args.startup_timeout)
        info = worker.call("init", timeout=args.startup_timeout, model=model_path, initial_peers=initial_peers,
                           host_ip=topology.ips["client"], dtype=args.dtype, threads=args.client_threads)
        logger.info("client joined as %s; %d blocks, %s", info["peer_id"], info["num_blocks"], info["dtype"])
        meta["dtype_resolved"] = info["dtype"]
        for index, (group_configs, group_envs) in enumerate(server_groups(configs, envs)):
            run_group(args, index, group_configs, group_envs, topology, swarm, worker, nodes, ranges, server_threads,
                      meta, records, out_dir)
    except (KeyboardInterrupt, Interrupted) as error:
        logger.error("interrupted: tearing down")
        meta["incomplete"] = f"interrupted ({error or 'SIGINT'})"
        raise
    except BaseException as error:
        meta["incomplete"] = f"{type(error).__name__}: {str(error)[:2000]}"
        raise
    finally:
        if swarm is not None:
            swarm.stop()
        leftovers = topology.destroy()
        logger.info("torn down after %.1f s; namespaces left behind: %s", time.monotonic() - began, leftovers or "none")
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        meta["machine"]["loadavg_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
        meta["seconds"] = round(time.monotonic() - began, 1)
        meta["leftover_namespaces"] = leftovers
        meta["logs"] = str(log_dir) if leftovers or args.keep_logs or "incomplete" in meta else None
        if meta["logs"] is None:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            logger.info("process logs kept in %s", log_dir)
        env_order = {env.name: i for i, env in enumerate(envs)}
        config_order = {config.name: i for i, config in enumerate(configs)}
        done = sorted((key for key in records if "summary" in records[key]), key=lambda k: (env_order[k[0]], config_order[k[1]]))
        summaries = [records[key]["summary"] for key in done]
        outputs = report.write_sweep_outputs(out_dir, meta, summaries, plots=not args.no_plots) if summaries or \
            "incomplete" not in meta else {}
    return {"meta": meta, "summaries": summaries, "out_dir": str(out_dir), "outputs": outputs}


def run_group(args, index: int, group_configs: list[knobs.Configuration], group_envs: list[presets.Environment],
              topology: netns.Topology, swarm, worker, nodes: list[str], ranges: list[tuple[int, int]], server_threads: int,
              meta: dict, records: dict[tuple[str, str], dict], out_dir: Path) -> None:
    """Start one server set per distinct server flags of the group's configurations (configurations that differ
    only on the client share it), run every environment x repeat x configuration, write each (configuration,
    environment)'s record as soon as it is complete, stop the servers."""
    server_nodes = nodes[1:]
    advertise_env = any(config.bandwidth_sensitive for config in group_configs)  # then the group has one environment
    sets: dict[tuple[str, ...], list[str]] = {}
    names: dict[str, list[str]] = {}
    for config in group_configs:
        flags = tuple(config.server_args())
        if flags not in sets:
            sets[flags] = [f"{node}.g{index}c{len(sets)}" for node in server_nodes]
            for name, node, blocks in zip(sets[flags], server_nodes, ranges):
                advertised = (group_envs[0].advertised_mbps(node, nodes, UNSHAPED_ADVERTISED_MBPS)
                              if advertise_env else FIXED_ADVERTISED_MBPS)
                swarm.start_server(name, node, blocks, list(flags), args.dtype, advertised, server_threads)
                # one at a time: a server measures its throughput and planner profile as it starts (once per
                # range; then cached), and servers measuring at once on this machine would slow each other
                _wait_online(worker, swarm, [name], args.startup_timeout)
        names[config.name] = sets[flags]
    everyone = [name for group in sets.values() for name in group]
    try:
        _wait_online(worker, swarm, everyone, args.startup_timeout)
        logger.info("servers %s online", sorted(everyone))
        background = measure_background(topology, args.background_s)
        bar = progress_bar(len(group_envs) * args.repeats * len(group_configs), f"server set {index}", unit="run")
        for env in group_envs:
            topology.apply(env)
            if args.warmup_round_tokens:
                for config in group_configs:
                    run_with_retries(args, topology, swarm, worker, env, config, names, nodes, args.warmup_round_tokens)
            for repeat in range(args.repeats):
                order = group_configs if repeat % 2 == 0 else list(reversed(group_configs))
                for config in order:
                    rep = run_with_retries(args, topology, swarm, worker, env, config, names, nodes)
                    bar.update()
                    record = records.setdefault((env.name, config.name), new_record(
                        args, env, config, nodes, topology, rep, names[config.name], meta, background))
                    record["repeats"].append(rep["repeat"])
                    record["failed_attempts"] = record.get("failed_attempts", []) + rep["failed_attempts"]
            for config in group_configs:
                record = records[(env.name, config.name)]
                record["summary"] = summarize(record)
                (out_dir / "runs" / f"{config.name}-{env.name}.json").write_text(json.dumps(report.clean_json(record), indent=1))
                log_summary(record["summary"])
        bar.close()
    finally:
        swarm.stop_servers()


def server_groups(configs: list[knobs.Configuration], envs: list[presets.Environment]):
    """Server sets started together; their configurations run side by side (interleaved per repeat, so that a busy
    moment of the machine hits them alike, with the same servers alive). Without a bandwidth-sensitive configuration
    one group keeps its servers across every environment; with one, every environment gets a group of all the
    configurations whose servers advertise its speed."""
    if not any(config.bandwidth_sensitive for config in configs):
        return [(configs, envs)]
    return [(configs, [env]) for env in envs]


def log_summary(s: dict) -> None:
    if s.get("mode") == "generate":
        logger.info("%s %s: %.1f tok/s through generate(), %d steps through the chain (%d token trees), %.2f tokens "
                    "per step", s["env"], s["config"], s["decode_tokens_per_s"], s["decode_steps"], s["tree_rounds"],
                    s["tokens_per_step"] or 0.0)
        return
    logger.info("%s %s: %.1f tok/s, step %.1f ms (floor %.1f ms, x%.2f), %.1f KB/step, iface/process %s",
                s["env"], s["config"], s["decode_tokens_per_s"], s["step_median_s"] * 1e3, s["floor_s"] * 1e3,
                s["measured_over_floor"], s["step_wire_bytes"] / 1e3, ", ".join(f"{a:.3f}" for a in s["iface_over_app"]))


def _wait_online(worker, swarm, names: list[str], timeout: float) -> None:
    """Wait for the servers in the client's DHT view, failing early if one of them dies."""
    deadline = time.monotonic() + timeout
    while True:
        swarm.check_servers()
        left = max(deadline - time.monotonic(), 0.0)
        missing = worker.call("wait_online", timeout=60, names=names, timeout_s=min(10.0, left))["missing"]
        if not missing:
            return
        if left <= 0:
            raise TimeoutError(f"servers {missing} did not come online within {timeout:g} s")


def measure_background(topology: netns.Topology, seconds: float) -> dict | None:
    """Bytes and packets per second each uplink carries with the swarm up but idle (DHT upkeep)."""
    if seconds <= 0:
        return None
    before, began = topology.counters(), time.monotonic()
    time.sleep(seconds)
    after, elapsed = topology.counters(), time.monotonic() - began
    return {"seconds": elapsed, "per_s": {node: {key: (after[node][key] - before[node][key]) / elapsed
                                                 for key in ("tx_bytes", "tx_packets")} for node in after}}


# what a repeat keeps of the worker's `run` result: the step loop's steps, or a `model.generate` run's figures
REPEAT_FIGURES = ("mode", "steps", "generation_s", "warmup_s", "prompt_source", "first_token_s", "batch", "new_tokens",
                  "speculation")


def run_one(args: argparse.Namespace, topology: netns.Topology, worker, env: presets.Environment,
            config: knobs.Configuration, names: list[str], nodes: list[str], new_tokens: int) -> dict[str, Any]:
    """Run the workload (`new_tokens` tokens) once in the current shaping; the chain it took and one repeat's raw
    record."""
    snapshots: dict[str, dict] = {}
    marks_at: dict[str, float] = {}

    def on_mark(name: str) -> None:
        snapshots[name] = topology.counters()
        marks_at[name] = time.time()

    qdisc_before = topology.qdisc_stats()
    result = worker.call("run", timeout=args.run_timeout, on_mark=on_mark, allowed=names,
                         settings=client_settings(config, env, nodes, args.request_timeout), batch=args.batch, prompt_len=args.prompt_len,
                         new_tokens=new_tokens, warmup_steps=args.warmup_steps, seed=args.seed,
                         max_length=args.max_length)
    hops = metrics.hops_of(result["chain"])
    expected = ["client"] + [metrics.node_of(name) for name in names] + ["client"]
    got = [hops[0][0]] + [dst for _, dst in hops]
    if got != expected or [span["name"] for span in result["chain"]] != names:
        raise RuntimeError(f"the client routed through {[span['name'] for span in result['chain']]}, expected {names}")
    measured = {key: result[key] for key in REPEAT_FIGURES if key in result}
    return {"chain": result["chain"], "hops": hops, "client_cpu": result["client_cpu"], "repeat": {
        **measured, "counters": snapshots, "mark_times": marks_at, "qdisc_before": qdisc_before,
        "qdisc_after": topology.qdisc_stats(), "loadavg": os.getloadavg()}}


def run_with_retries(args, topology, swarm, worker, env, config, names, nodes, new_tokens: int | None = None) -> dict[str, Any]:
    """run_one (`new_tokens`, default the sweep's), again after a failed attempt (a loaded machine can make a DHT
    lookup or a step time out)."""
    from benchmarks.netbench.swarm import WorkerError

    failures: list[str] = []
    for attempt in range(args.retries + 1):
        try:
            rep = run_one(args, topology, worker, env, config, names[config.name], nodes, new_tokens or args.new_tokens)
            rep["failed_attempts"] = failures
            return rep
        except WorkerError as error:
            swarm.check_servers()  # a dead server is not worth retrying
            if attempt == args.retries:
                raise
            failures.append(str(error).splitlines()[0][:500])
            logger.warning("%s %s failed (%s); waiting for the servers, then retrying", env.name, config.name, failures[-1])
            time.sleep(args.retry_wait)
            _wait_online(worker, swarm, [n for group in names.values() for n in group], args.startup_timeout)
    raise AssertionError("unreachable")


def client_settings(config: knobs.Configuration, env: presets.Environment, nodes: list[str],
                    request_timeout: float = 600.0) -> dict[str, Any]:
    """The configuration's client settings, plus a step timeout long enough for a wide prefill at 20 Mbit/s."""
    settings = {"request_timeout": request_timeout, **config.client_settings()}
    if config.bandwidth_sensitive:
        settings["link_bandwidth_mbps"] = env.advertised_mbps("client", nodes, UNSHAPED_ADVERTISED_MBPS)
    return settings


def new_record(args, env, config, nodes, topology, rep, names, meta, background) -> dict[str, Any]:
    return {
        "env": env.to_dict(), "config": config.to_dict(), "model": meta["model"], "model_name": meta["model_name"],
        "model_path": meta["model_path"], "dtype": meta.get("dtype_resolved", meta["dtype"]), "ranges": meta["ranges"],
        "workload": {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "warmup_steps": args.warmup_steps, "seed": args.seed, "max_length": args.max_length},
        "nodes": nodes, "ips": topology.ips, "shaping": topology.shaping_log, "servers": names, "chain": rep["chain"],
        "hops": rep["hops"], "client_cpu": rep["client_cpu"], "hop_rates_mbps": [env.rate_mbps(src, dst, nodes) for src, dst in rep["hops"]],
        "client_settings": client_settings(config, env, nodes, args.request_timeout), "server_args": config.server_args(),
        "background": background, "repeats": [],
    }


def summarize(record: dict) -> dict[str, Any]:
    """The run's figures with the planner's predictions beside them."""
    return {**metrics.summarize(record), "predicted": predict.predictions(record)}


def rebuild_report(directory: str) -> dict[str, str]:
    folder = Path(directory)
    previous = json.loads((folder / "summary.json").read_text())["meta"] if (folder / "summary.json").exists() else None
    records = [json.loads(path.read_text()) for path in sorted((folder / "runs").glob("*.json"))]
    if not records:
        raise SystemExit(f"no runs in {folder / 'runs'}")
    order_envs = [env["name"] for env in previous["envs"]] if previous else []
    order_configs = [config["name"] for config in previous["configs"]] if previous else []

    def key(record):
        env, config = record["env"]["name"], record["config"]["name"]
        return (order_envs.index(env) if env in order_envs else 99, order_configs.index(config) if config in order_configs else 99)

    summaries = [summarize(record) for record in sorted(records, key=key)]
    meta = previous or {"model_name": records[0]["model_name"], "command": "?", "model_note": "?", "hidden_size": "?",
                        "num_blocks": "?", "dtype": records[0]["dtype"], "server_nodes": [], "ranges": records[0]["ranges"],
                        "batch": records[0]["workload"]["batch"], "prompt_len": records[0]["workload"]["prompt_len"],
                        "new_tokens": records[0]["workload"]["new_tokens"], "warmup_steps": records[0]["workload"]["warmup_steps"],
                        "machine": {"cpus": "?", "loadavg_start": "?", "kernel": "?", "git": "?"}, "started": "?"}
    return report.write_sweep_outputs(folder, meta, summaries)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "presets":
        for env in presets.PRESETS.values():
            print(f"{env.name}: {env.description}  [paper: {env.paper}]")
        print("custom:RATE  every uplink RATE (e.g. custom:50mbit, or just 50mbit)")
        print("matrix:FILE  per site-pair rates from a JSON/YAML file (rates_mbps, placement)")
        return 0
    if args.command == "cleanup":
        reason = check_privileges()
        if reason:
            raise SystemExit(f"netbench cleanup {reason}")
        removed = netns.cleanup_stale(include_live=args.all)
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    if args.command == "report":
        for name, path in rebuild_report(args.dir).items():
            print(f"{name}: {path}")
        return 0
    result = run_sweep(args)
    print((Path(result["out_dir"]) / "summary.md").read_text())
    return 1 if result["meta"]["leftover_namespaces"] else 0
