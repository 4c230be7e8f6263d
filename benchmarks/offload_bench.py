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
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.netbench import chains, models

logger = logging.getLogger("benchmarks.offload_bench")

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "benchmarks" / "results" / "offload"
BATCH_OFFLOADS = (0.0, 0.5, 1.0)


def chain_list(num_blocks: int) -> list[chains.Chain]:
    """One server per block without offload, against the first blocks on one server with the planner's alpha."""
    return [chains.Chain("a", f"{num_blocks} servers, --offload 0", tuple((i, i + 1) for i in range(num_blocks)),
                         "offload:0"),
            chains.Chain("b", f"{num_blocks - 1} servers, --offload auto",
                         ((0, num_blocks - 1), (num_blocks - 1, num_blocks)), "offload:auto")]


def build_parser() -> argparse.ArgumentParser:
    parser = chains.build_parser("benchmarks.offload_bench", __doc__, OUT_DIR, "E1,E5", "1400MiB")
    parser.add_argument("--probe-model", default="wide:2",
                        help="the batch-size probe's model: its server holds all of its blocks (wide:2: two blocks of wide)")
    parser.add_argument("--alloc-timeout", type=float, default=0.5, help="--alloc-timeout of the batch-size probes")
    return parser


# ---------------------------------------------------------------------------------- the memory figures


def meta_backend(model_path: str, start: int, end: int):
    """A BlockBackend of blocks [start, end) on the meta device: the server's byte accounting without the weights."""
    import torch

    from bloombee.loading import load_model_config
    from bloombee.loading.weights import resolve_dtype
    from bloombee.models import family_for_config
    from bloombee.models.core.stack import BlockStack
    from bloombee.server.backend import BlockBackend

    config = load_model_config(model_path)
    dtype = resolve_dtype("auto", config)
    with torch.device("meta"):
        stack = BlockStack(family_for_config(config), config, start, end).to(dtype)
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


def markdown(result: dict) -> str:
    """The summary page: the premise, both chains per environment with the predictions, the batch table."""
    meta = result["meta"]
    lines = [f"# KV offload: {len(meta['chains'][0]['ranges'])} servers without offload vs "
             f"{len(meta['chains'][1]['ranges'])} with the planner's alpha", "",
             *chains.describe(meta), "",
             "| server blocks | weights | room for sessions | KV of --cache-tokens | alpha (auto, expected) |", "|---|---|---|---|---|"]
    for fig in meta["memory"]:
        lines.append(f"| {fig['blocks'][0]}:{fig['blocks'][1]} | {chains.mib(fig['weight_bytes'])} | {chains.mib(fig['room_bytes'])} | "
                     f"{chains.mib(fig['kv_bytes'])} | {fig['alpha']} |")
    lines += [""] + chains.table(result["chains"], chains.LEAD_COLUMNS + ALPHA_COLUMNS + chains.STEP_COLUMNS)
    lines += [""] + [f"- {env}: the 2-server chain's decode tokens/s is {speedup:+.1%} against the 3-server chain's"
                     for env, speedup in result["speedup"].items()]
    lines += ["", f"Largest batch whose session opens on one server of all blocks of {meta['probe_model']} at "
              f"`--device-memory {meta['device_memory']}` "
              f"`--host-memory {meta['host_memory']}`, max_length {meta['max_length']}:", "",
              "| --offload | largest batch | budget arithmetic | device / host bytes per row | refusal one above |", "|---|---|---|---|---|"]
    for row in result["batches"]:
        lines.append(f"| {row['offload']:g} | {row['max_batch']} | {row['expected_max_batch']} | "
                     f"{chains.mib(row['per_row_device_bytes'])} / {chains.mib(row['per_row_host_bytes'])} | {row['refusal']} |")
    return "\n".join(lines) + "\n"


ALPHA_COLUMNS: list[chains.Column] = [("alpha announced", lambda row: str(row["alpha_announced"])),
                                      ("planner alpha (at max_length)",
                                       lambda row: str(row["planner_at_max_length"]["alphas"]))]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = chains.start(build_parser(), argv)
    from bloombee.loading import load_model_config
    from bloombee.server.memory import parse_bytes

    model_path, model_name, _ = models.resolve(args.model)
    layout = chain_list(load_model_config(model_path).num_hidden_layers)
    budget, cache_tokens = parse_bytes(args.device_memory), args.batch * args.max_length
    memory = [expected_alpha(model_path, blocks, budget, cache_tokens) for blocks in ((0, 1), layout[1].ranges[0])]
    check_premise(memory)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    meta = {**chains.base_meta(args, "benchmarks.offload_bench", argv, model_name, layout),
            "probe_model": args.probe_model, "memory": memory}
    batches = batch_table(args)
    rows = chains.measure(args, model_path, model_name, layout, "offload", out, "offload-bench")
    for row in rows:
        if row["chain"] == "b" and row["alpha_announced"][0] != memory[-1]["alpha"]:
            logger.warning("chain b's first server announced alpha %s, the rule gives %s", row["alpha_announced"][0],
                           memory[-1]["alpha"])
    speedup = {env: figures["b"] for env, figures in chains.speedups(rows).items()}
    result = {"meta": meta, "chains": rows, "speedup": speedup, "batches": batches}
    print(chains.finish(out, "offload", result, markdown, began))
    return 0


if __name__ == "__main__":
    sys.exit(main())
