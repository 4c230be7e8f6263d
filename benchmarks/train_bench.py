"""Prompt tuning through a swarm: training steps per second and bytes per step, with and without micro-batches.

In netbench's network namespaces shaped as each environment (`--envs`, as root), two servers split the model's
blocks and a client in its own namespace runs deep prompt tuning (`tuning_mode="deep_ptune"`, an Adam step on the
prompts after each forward and backward through the swarm) on batches of BATCH rows of SEQUENCE tokens, once per
`--micro-batches` count. Per run: steps/s, the bytes the client's link carried per step (both directions, read
from its interface: every byte of a stateless chain passes the client), and the loss before and after.

    sudo unshare --net -- bash -c 'ip link set lo up && exec .venv/bin/python -m benchmarks.train_bench \
        --envs E1 E5 --micro-batches 1 4 auto --output benchmarks/results/train_bench.json'
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bloombee.client import AutoDistributedModel
from bloombee.loading import load_model_config, resolve_model

RESULTS = Path(__file__).parent / "results"
BATCH, SEQUENCE, PREFIX = 4, 64, 8
WARMUP = 1  # steps not timed: the first routes, picks codecs and measures links


def micro_batch_count(text: str) -> int | str:
    return text if text == "auto" else int(text)


def link_bytes() -> int:
    """Bytes this namespace's interfaces (loopback aside) have sent and received."""
    total = 0
    for device in Path("/sys/class/net").iterdir():
        if device.name != "lo":
            total += sum(int((device / "statistics" / f"{way}_bytes").read_text()) for way in ("tx", "rx"))
    return total


def train(model, steps: int, vocab_size: int) -> dict:
    """`steps` timed training steps (after WARMUP) on a fixed random batch: steps/s, bytes per step, the losses."""
    optimizer = torch.optim.Adam(model.prompt_tuning.parameters(), lr=1e-2)
    ids = torch.randint(3, vocab_size, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(WARMUP + steps):
        if step == WARMUP:
            began, bytes_before = time.perf_counter(), link_bytes()
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    seconds, carried = time.perf_counter() - began, link_bytes() - bytes_before
    return {"steps_per_s": steps / seconds, "bytes_per_step": carried / steps, "loss_first": losses[0],
            "loss_last": losses[-1]}


def client_in_namespace(args: argparse.Namespace) -> None:
    """The client's part, run in its namespace: wait for both servers, then one run per micro-batch count."""
    from benchmarks.netbench.swarm import wait_for_servers
    from bloombee.dht.peers import start_dht

    path = Path(args.model)
    vocab_size = load_model_config(path).vocab_size
    dht = start_dht(args.initial_peers, host_maddrs=[f"/ip4/{args.client_in}/tcp/0"], nat_traversal=False,
                    client_mode=True)
    for micro_batches in args.micro_batches:
        torch.manual_seed(0)  # the same prompts' initial values in every run
        with AutoDistributedModel.from_pretrained(str(path), dht=dht, dtype=torch.float32, tuning_mode="deep_ptune",
                                                  pre_seq_len=PREFIX, micro_batches=micro_batches,
                                                  link_bandwidth_mbps=args.link_mbps) as model:
            wait_for_servers(model, 2)
            row = {"env": args.env, "micro_batches": micro_batches, **train(model, args.steps, vocab_size)}
            print(json.dumps(row), flush=True)
    dht.shutdown()


def run_env(path: Path, env_name: str, args: argparse.Namespace, logs: Path) -> list[dict]:
    """Two servers and the client in namespaces shaped as `env_name`; the client's rows."""
    from benchmarks.netbench import netns, presets
    from benchmarks.netbench.swarm import NetSwarm, client_rows

    env, n = presets.parse_environment(env_name), load_model_config(path).num_hidden_layers
    link = env.uplink_mbps or 10000.0
    with netns.Topology(["client", "s0", "s1"]) as topology:
        topology.apply(env)
        with NetSwarm(topology, str(path), logs / env_name) as swarm:
            swarm.start_dht()
            swarm.wait_dht()
            for index, blocks in enumerate(((0, n // 2), (n // 2, n))):
                swarm.start_server(f"s{index}", f"s{index}", blocks, [], "auto", link, threads=1)
            argv = [sys.executable, "-m", "benchmarks.train_bench", "--client-in", topology.ips["client"],
                    "--model", str(path), "--env", env_name, "--steps", str(args.steps), "--link-mbps", str(link),
                    "--micro-batches", *map(str, args.micro_batches), "--initial-peers", *swarm.initial_peers]
            rows = client_rows(topology, argv)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    envs = list(dict.fromkeys(row["env"] for row in results["rows"]))
    counts = list(dict.fromkeys(row["micro_batches"] for row in results["rows"]))
    width = 0.8 / len(counts)
    for offset, count in enumerate(counts):
        rows = {row["env"]: row for row in results["rows"] if row["micro_batches"] == count}
        xs = [index + offset * width for index in range(len(envs))]
        left.bar(xs, [rows[env]["steps_per_s"] for env in envs], width, label=f"micro-batches: {count}")
        right.bar(xs, [rows[env]["bytes_per_step"] / 1e6 for env in envs], width, label=f"micro-batches: {count}")
    for axis, label in ((left, "training steps/s"), (right, "MB on the client's link per step")):
        axis.set_xticks([index + width * (len(counts) - 1) / 2 for index in range(len(envs))], envs)
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    fig.suptitle(f"{results['model']}: deep prompt tuning through 2 servers, batch {BATCH} x {SEQUENCE} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bloombee-tiny")
    parser.add_argument("--envs", nargs="+", default=["E1", "E5"], help="netbench environments (as root)")
    parser.add_argument("--micro-batches", type=micro_batch_count, nargs="+", default=[1, 4, "auto"],
                        help="micro-batch counts compared (auto: what a client chooses by default)")
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per run")
    parser.add_argument("--output", default=str(RESULTS / "train_bench.json"))
    parser.add_argument("--client-in", default=None, help=argparse.SUPPRESS)  # the client's part, at this address
    parser.add_argument("--env", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--link-mbps", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.client_in:
        client_in_namespace(args)
        return
    path = resolve_model(args.model)
    logs = Path(tempfile.mkdtemp(prefix="train-bench-"))
    rows = [row for env in args.envs for row in run_env(path, env, args, logs)]
    results = {"model": args.model, "batch": BATCH, "sequence": SEQUENCE, "pre_seq_len": PREFIX, "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
    plot(results, Path(args.output).with_suffix(".png"))


if __name__ == "__main__":
    main()
