"""Concurrent sessions on a small swarm, batching across sessions on and off, side by side.

For each topology (one server holding every block, two servers of half the blocks each, ...: `--servers`; one torch
thread each) and for batching on (the default) and off (`--max-batch-rows 1`: each step computed alone), one client
process runs K sessions in threads, each a 16-token prompt and 32 greedy tokens (`--new-tokens`) step by step. Per K:
the aggregate tokens/s of the K sessions at once, and of the same K sessions one after another (the baseline a server
that computes one session's step at a time approaches), the ratio, p50/p99 of the decode-step latency, sessions
admitted, and how many sessions gave exactly the tokens of their solo run. The two runs alternate `--repeats` times (3),
as this machine's speed drifts from one second to the next: a row gives the median of the paired ratios and their range.
And per server, while the K sessions last ran at once: its steps per forward, its mean forward's time, and what the
model of the chain (`planner.chain.SpanFigures`, from the server's announced figures) predicts for a forward of that
many steps.

    python -m benchmarks.load_bench --ks 1 2 4 8 16 32

With `--env E5` (or any netbench environment; as root) the servers and the client run in netbench's network
namespaces, every uplink shaped as the environment says; by default everything is on loopback:

    sudo unshare --net -- bash -c 'ip link set lo up && exec .venv/bin/python -m benchmarks.load_bench \
        --model pipeline --servers 3 --ks 1 2 4 8 --env E5 --output benchmarks/results/load_pipeline_e5.json'
"""

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.netbench.models import resolve
from bloombee.cli.common import freeze_startup_heap
from bloombee.client import AutoDistributedModel, RequestRejected
from bloombee.client.routing import span_figures
from bloombee.dht.records import ServerRecord
from bloombee.loading import dht_prefix, load_model_config, resolve_model
from bloombee.local_swarm import LocalSwarm

RESULTS = Path(__file__).parent / "results"
PROMPT, NEW_TOKENS = 16, 32  # a session's prompt and generated tokens (--new-tokens)
BATCHING = {"on": (), "off": ("--max-batch-rows", "1")}


@torch.inference_mode()
def one_session(model, prompt: torch.Tensor, out: dict, new_tokens: int) -> None:
    """Prefill, then new_tokens - 1 decode steps, timed; `out` gets the tokens and step times, or the refusal."""
    try:
        with model.remote.inference_session(max_length=prompt.shape[1] + new_tokens) as session:
            token = model.head.logits(session.step(model.head.embed(prompt))[:, -1:]).argmax(-1)
            tokens, steps = [token], []
            for _ in range(new_tokens - 1):
                began = time.perf_counter()
                token = model.head.logits(session.step(model.head.embed(token)))[:, -1:].argmax(-1)
                steps.append(time.perf_counter() - began)
                tokens.append(token)
            out.update(tokens=torch.cat(tokens, dim=1), steps=steps)
    except RequestRejected as error:
        out["refused"] = str(error)


def in_threads(calls: list, concurrent: bool) -> float:
    """Run each of `calls` in a thread of its own, all at once or one after another; the wall time."""
    threads = [threading.Thread(target=call) for call in calls]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
        if not concurrent:
            thread.join()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began


def run_sessions(model, prompts: list[torch.Tensor], concurrent: bool, new_tokens: int) -> tuple[list[dict], float]:
    """The sessions of `prompts` in threads, all at once or one after another; their outcomes and the wall time."""
    outs = [{} for _ in prompts]
    calls = [lambda prompt=prompt, out=out: one_session(model, prompt, out, new_tokens)
             for prompt, out in zip(prompts, outs)]
    return outs, in_threads(calls, concurrent)


def run_k(model, vocab_size: int, k: int, repeats: int, new_tokens: int) -> dict:
    """K sessions one after another, then all at once, `repeats` times in turn (this machine's speed drifts over
    seconds, so each ratio pairs two runs a moment apart): medians and the range of the pairs' ratios, step latencies
    over every concurrent run, sessions exact against their solo run in every repeat; forwards of the last repeat."""
    generator = torch.Generator().manual_seed(k)
    prompts = [torch.randint(3, vocab_size, (1, PROMPT), generator=generator) for _ in range(k)]
    pairs, exact, steps, solo_steps, refusals = [], [True] * k, [], [], set()
    for _ in range(repeats):
        alone, alone_wall = run_sessions(model, prompts, False, new_tokens)
        before = forward_totals(model)
        outs, wall = run_sessions(model, prompts, True, new_tokens)
        forwards = forwards_against_model(model, before, forward_totals(model))
        done = [index for index, (out, solo) in enumerate(zip(outs, alone)) if "tokens" in out and "tokens" in solo]
        for index in range(k):
            exact[index] &= index in done and torch.equal(outs[index]["tokens"], alone[index]["tokens"])
        steps += [step for index in done for step in outs[index]["steps"]]
        solo_steps += [step for solo in alone if "steps" in solo for step in solo["steps"]]
        refusals |= {out["refused"].split(": ", 1)[1][:120] for out in outs if "refused" in out}
        pairs.append((len(done), len(done) * new_tokens / wall, len(done) * new_tokens / alone_wall))
    steps.sort()
    ratios = sorted(concurrent / one_at_a_time for _, concurrent, one_at_a_time in pairs)
    admitted = min(count for count, _, _ in pairs)
    return {"k": k, "admitted": admitted, "refused": k - admitted, "repeats": repeats,
            "tokens_per_s": statistics.median(concurrent for _, concurrent, _ in pairs),
            "one_at_a_time_tokens_per_s": statistics.median(one_at_a_time for _, _, one_at_a_time in pairs),
            "ratio": statistics.median(ratios), "ratio_range": [ratios[0], ratios[-1]], "exact": sum(exact),
            "step_p50_ms": 1e3 * statistics.median(steps) if steps else None,
            "step_p99_ms": 1e3 * steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else None,
            "solo_step_p50_ms": 1e3 * statistics.median(solo_steps) if solo_steps else None,
            "refusals": sorted(refusals), "forwards": forwards}


def forward_totals(model) -> dict[str, tuple[ServerRecord, dict]]:
    """Each usable server's record as it would announce it now and its forwards so far (count, steps, seconds)."""
    totals = {}
    for peer in model.remote.manager.usable_servers():
        info = model.remote.server_info(peer)
        record = ServerRecord.model_validate({key: info[key] for key in ServerRecord.model_fields if key in info})
        totals[peer] = (record, info["forwards"])
    return totals


def forwards_against_model(model, before: dict, after: dict) -> list[dict]:
    """Per server, in chain order: its forwards between two `forward_totals`, their mean steps and time, and the
    model's time for a forward of a one-vector step beside that many other steps' vectors."""
    rows = []
    for peer, (record, totals) in sorted(after.items(), key=lambda item: item[1][0].start_block):
        count, steps, seconds = (totals[key] - before[peer][1][key] for key in ("count", "steps", "seconds"))
        if not count:
            continue
        blocks = record.end_block - record.start_block
        figures = replace(span_figures(record, blocks, model.config.hidden_size), busy_vectors=steps / count - 1)
        rows.append({"server": record.public_name or peer[-8:], "steps_per_forward": steps / count,
                     "forward_ms": 1e3 * seconds / count,
                     "predicted_forward_ms": 1e3 * blocks * figures.forward_seconds(1)})
    return rows


def blocks_of(index: int, servers: int, num_blocks: int) -> str:
    return f"{index * num_blocks // servers}:{(index + 1) * num_blocks // servers}"


def run_client(model, ks: list[int], vocab_size: int, label: dict, repeats: int, new_tokens: int) -> list[dict]:
    """A warm-up session, then each K: the rows, printed as they come. This one process runs every session, so a
    full garbage collection of its start-up heap would stall all K at once: it is frozen, as servers freeze theirs."""
    run_sessions(model, [torch.tensor([[3] * PROMPT])], False, new_tokens)
    freeze_startup_heap()
    rows = []
    for k in ks:
        rows.append({**label, **run_k(model, vocab_size, k, repeats, new_tokens)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_swarm(path: Path, servers: int, batching: str, ks: list[int], logs: str | None, repeats: int,
              new_tokens: int, server_flags: list[str]) -> list[dict]:
    """The rows of `servers` servers on loopback splitting the model's blocks evenly, batching on or off, each server
    started with `server_flags` besides."""
    config = load_model_config(path)
    n = config.num_hidden_layers
    with LocalSwarm(str(path), n, dht_prefix(path), log_dir=logs) as swarm:
        for index in range(servers):
            swarm.add_server("--blocks", blocks_of(index, servers, n), *BATCHING[batching], *server_flags)
        with AutoDistributedModel.from_pretrained(str(path), initial_peers=swarm.initial_peers) as model:
            model.remote.manager.update(force=True)
            label = {"topology": topology_name(servers), "batching": batching}
            return run_client(model, ks, config.vocab_size, label, repeats, new_tokens)


def topology_name(servers: int) -> str:
    return f"{servers} server{'s' if servers > 1 else ''}"


def run_shaped_swarm(path: Path, servers: int, batching: str, ks: list[int], env_name: str, logs: Path,
                     repeats: int, new_tokens: int) -> list[dict]:
    """The same in netbench's namespaces shaped as `env_name`: servers s0, s1, ..., the client's part of this script
    in the namespace `client`, its rows read from its output."""
    from benchmarks.netbench import netns, presets
    from benchmarks.netbench.swarm import NetSwarm, client_rows

    env, n = presets.parse_environment(env_name), load_model_config(path).num_hidden_layers
    nodes = ["client", *(f"s{index}" for index in range(servers))]
    with netns.Topology(nodes) as topology:
        topology.apply(env)
        with NetSwarm(topology, str(path), logs / f"{servers}-{batching}") as swarm:
            swarm.start_dht()
            swarm.wait_dht()
            link = env.uplink_mbps or 10000.0
            for index in range(servers):
                swarm.start_server(f"s{index}", f"s{index}", tuple(map(int, blocks_of(index, servers, n).split(":"))),
                                   list(BATCHING[batching]), "auto", link, threads=1)
            argv = [sys.executable, "-m", "benchmarks.load_bench", "--client-in", topology.ips["client"], "--model",
                    str(path), "--ks", *map(str, ks), "--servers", str(servers), "--batching", batching,
                    "--env", env_name, "--repeats", str(repeats), "--new-tokens", str(new_tokens),
                    "--initial-peers", *swarm.initial_peers]
            rows = client_rows(topology, argv)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def client_in_namespace(args: argparse.Namespace) -> None:
    """The client's part of `run_shaped_swarm`, run in its namespace: wait for the servers, then the K loop."""
    from benchmarks.netbench import presets
    from benchmarks.netbench.swarm import wait_for_servers
    from bloombee.dht.peers import start_dht

    path = Path(args.model)
    dht = start_dht(args.initial_peers, host_maddrs=[f"/ip4/{args.client_in}/tcp/0"], nat_traversal=False,
                    client_mode=True)
    link = presets.parse_environment(args.env).uplink_mbps or 10000.0
    with AutoDistributedModel.from_pretrained(str(path), dht=dht, link_bandwidth_mbps=link) as model:
        wait_for_servers(model, args.servers[0])
        label = {"topology": topology_name(args.servers[0]), "batching": args.batching, "env": args.env}
        run_client(model, args.ks, load_model_config(path).vocab_size, label, args.repeats, args.new_tokens)
    dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bloombee-tiny", help="a model, or a netbench model name (pipeline, ...)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2], help="chains compared, by server count")
    parser.add_argument("--repeats", type=int, default=3, help="one-at-a-time and concurrent runs per K, in turn")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="greedy tokens each session generates")
    parser.add_argument("--env", default=None, help="a netbench environment (E1..E6, as root): shaped namespaces")
    parser.add_argument("--output", default=str(RESULTS / "load.json"))
    parser.add_argument("--logs", default=None, help="folder for the servers' logs (default: a temporary one)")
    parser.add_argument("--server-flags", default="", help="more bloombee-server flags for every server on loopback, "
                        "e.g. \"--device cuda --quant-type none\" (default: none)")
    parser.add_argument("--client-in", default=None, help=argparse.SUPPRESS)  # the client's part, at this address
    parser.add_argument("--batching", default="on", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be at least 2 (a prompt step and a decode step), not {args.new_tokens}")
    server_flags = shlex.split(args.server_flags)
    if server_flags and args.env:
        parser.error("--server-flags is for servers on loopback; netbench's --env starts its servers itself")
    torch.set_num_threads(1)
    if args.client_in:
        client_in_namespace(args)
        return
    model = resolve_model(resolve(args.model)[0])
    # the shaped swarms' logs; on loopback each LocalSwarm keeps its own (in --logs, or a folder it makes)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="load-bench-")) if args.env else None

    def swarm_rows(servers: int, batching: str) -> list[dict]:
        if args.env:
            return run_shaped_swarm(model, servers, batching, args.ks, args.env, logs, args.repeats, args.new_tokens)
        return run_swarm(model, servers, batching, args.ks, args.logs, args.repeats, args.new_tokens, server_flags)

    rows = [row for servers in args.servers for batching in BATCHING for row in swarm_rows(servers, batching)]
    results = {"model": args.model, "env": args.env or "loopback", "server_flags": server_flags, "prompt": PROMPT,
               "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
    plot(results, Path(args.output).with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for topology in dict.fromkeys(row["topology"] for row in results["rows"]):
        for batching, style in (("on", "-"), ("off", "--")):
            rows = [row for row in results["rows"] if row["topology"] == topology and row["batching"] == batching]
            ks = [row["k"] for row in rows]
            label = f"{topology}, batching {batching}"
            left.plot(ks, [row["tokens_per_s"] for row in rows], "o" + style, label=label)
            right.plot(ks, [row["step_p99_ms"] for row in rows], "s" + style, label=label)
        solo = [row for row in results["rows"] if row["topology"] == topology and row["batching"] == "on"]
        left.plot([row["k"] for row in solo], [row["one_at_a_time_tokens_per_s"] for row in solo], ":", color="grey",
                  label=f"{topology}, one session at a time")
    left.set(xscale="log", xlabel="concurrent sessions K", ylabel="tokens/s, all sessions")
    right.set(xscale="log", xlabel="concurrent sessions K", ylabel="p99 decode step, ms")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle(f"{results['model']} ({results['env']}): sessions batched across on each server, or each step alone")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
