"""Issue 30: under one device-memory budget, the float32 chain against the fewer servers int8 and nf4 blocks need.

Every server gets the same `--device-memory` (enforced on this CPU as if the device were a GPU of that size) and
`--cache-tokens` = batch x max_length. The budget (default 1.75 float32 blocks with their caches) holds one block
and its cache in float32 and not two; each precision's chain has as many servers as the server's own rule
(`blocks_that_fit`) needs: chain a, `--quant-type none`, one block per server; chains b (int8) and c (nf4), as many
blocks per server as fit (all of them on one server for the wide model). The chains run side by side in one set of
netbench namespaces (their servers alive together, runs alternating), through netbench's own worker, metrics and
planner predictions: decode and end-to-end tokens/s, each beside the planner's, and each quantised chain's speed-up
over chain a.

    sudo unshare --net -- bash -c 'ip link set lo up && exec nice -n 10 .venv/bin/python -m benchmarks.quant_netbench'
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.netbench import chains, models
from bloombee.weight_formats import QUANT_TYPES

logger = logging.getLogger("benchmarks.quant_netbench")

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "benchmarks" / "results" / "quant"
BUDGET_BLOCKS = 1.75  # the default budget, in float32 blocks with their caches: one fits, two do not


def build_parser():
    return chains.build_parser("benchmarks.quant_netbench", __doc__, OUT_DIR, "E5", None,
                               f"every server's --device-memory (default: {BUDGET_BLOCKS:g} blocks of the model's dtype "
                               f"with their caches of --cache-tokens)")


def memory_figures(model_path: str, device_memory: str | None, cache_tokens: int) -> tuple[str, list[dict[str, Any]]]:
    """The budget (`device_memory`, else BUDGET_BLOCKS blocks of the checkpoint's dtype with their caches) and, per
    precision, the planner's bytes of one block's weights and of its cache of `cache_tokens`, and how many blocks a
    server holds at the budget by its own rule (0: not one)."""
    from bloombee.loading import load_model_config
    from bloombee.loading.weights import resolve_dtype
    from bloombee.planner.inputs import ModelSpec
    from bloombee.planner.model_config import model_section_from_config
    from bloombee.server.memory import WeightsDoNotFit, blocks_that_fit, parse_bytes

    config = load_model_config(model_path)
    dtype = resolve_dtype("auto", config)
    name = str(dtype).removeprefix("torch.")
    spec = ModelSpec.model_validate(model_section_from_config(config))
    kv = spec.kv_bytes_per_token(name) * cache_tokens
    device_memory = device_memory or f"{int(BUDGET_BLOCKS * (spec.weight_bytes(name) + kv)) >> 20}MiB"
    figures = []
    for quant in QUANT_TYPES:
        try:
            fit = blocks_that_fit(config, dtype, quant, parse_bytes(device_memory), cache_tokens)
        except WeightsDoNotFit:
            fit = 0
        figures.append({"quant": quant, "weight_bytes": spec.weight_bytes(name, quant), "kv_bytes": kv,
                        "blocks_per_server": fit, "servers": -(-config.num_hidden_layers // fit) if fit else None})
        logger.info("--quant-type %s: %d blocks per server at --device-memory %s", quant, fit, device_memory)
    return device_memory, figures


def check_premise(figures: list[dict]) -> None:
    """The budget must force the choice: one full-precision block fits and two do not, and int8 and nf4 need fewer
    servers."""
    full, quantised = figures[0], figures[1:]
    if full["blocks_per_server"] != 1 or any(not fig["servers"] or fig["servers"] >= full["servers"] for fig in quantised):
        raise SystemExit(f"--device-memory does not force the choice (one {full['quant']} block per server, fewer "
                         f"servers in int8 and nf4): {figures}")


def chain_list(num_blocks: int, figures: list[dict]) -> list[chains.Chain]:
    """Per precision, as many blocks per server as fit: chain a none, b int8, c nf4."""
    out = []
    for key, fig in zip("abc", figures):
        per = fig["blocks_per_server"]
        ranges = tuple((start, min(start + per, num_blocks)) for start in range(0, num_blocks, per))
        label = f"{len(ranges)} server{'s' if len(ranges) > 1 else ''}, --quant-type {fig['quant']}"
        out.append(chains.Chain(key, label, ranges, f"quant:{fig['quant']}"))
    return out


QUANT_COLUMNS: list[chains.Column] = [
    ("quant announced", lambda row: ", ".join(map(str, row["quant_announced"]))),
    ("alpha announced", lambda row: str(row["alpha_announced"])),
    ("end-to-end tok/s", lambda row: f"{row['summary']['e2e_tokens_per_s']:.2f}"),
]
PREDICTED_COLUMNS: list[chains.Column] = [
    ("predicted decode tok/s", lambda row: f"{row['predicted_decode_tokens_per_s']:.2f}"),
]


def markdown(result: dict) -> str:
    """The summary page: the budget per precision, the chains per environment with the predictions, the speed-ups."""
    meta = result["meta"]
    labels = {chain["key"]: chain["label"] for chain in meta["chains"]}
    lines = [f"# Quantised blocks: {labels['a']} against {labels['b']} and {labels['c']} at one device budget", "",
             *chains.describe(meta), "",
             "| --quant-type | weights per block | KV of --cache-tokens per block | blocks per server | servers |",
             "|---|---|---|---|---|"]
    lines += [f"| {fig['quant']} | {chains.mib(fig['weight_bytes'])} | {chains.mib(fig['kv_bytes'])} | "
              f"{fig['blocks_per_server']} | {fig['servers']} |" for fig in meta["memory"]]
    lines += [""] + chains.table(result["chains"], chains.LEAD_COLUMNS + QUANT_COLUMNS + chains.STEP_COLUMNS
                                 + PREDICTED_COLUMNS)
    lines += [""] + [f"- {env}: {labels[key]}: decode tokens/s {speedup:+.1%}, end-to-end "
                     f"{result['speedup_e2e'][env][key]:+.1%} against {labels['a']}"
                     for env, figures in result["speedup"].items() for key, speedup in figures.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = chains.start(build_parser(), argv)
    from bloombee.loading import load_model_config

    model_path, model_name, _ = models.resolve(args.model)
    args.device_memory, memory = memory_figures(model_path, args.device_memory, args.batch * args.max_length)
    check_premise(memory)
    layout = chain_list(load_model_config(model_path).num_hidden_layers, memory)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    meta = {**chains.base_meta(args, "benchmarks.quant_netbench", argv, model_name, layout), "memory": memory}
    rows = chains.measure(args, model_path, model_name, layout, "quant", out, "quant-netbench")
    expected = {chain.key: fig["quant"] for chain, fig in zip(layout, memory)}
    for row in rows:
        if any(quant != expected[row["chain"]] for quant in row["quant_announced"]):
            logger.warning("chain %s: its servers announced %s", row["label"], row["quant_announced"])
    result = {"meta": meta, "chains": rows, "speedup": chains.speedups(rows),
              "speedup_e2e": chains.speedups(rows, "e2e_tokens_per_s")}
    print(chains.finish(out, "quant", result, markdown, began))
    return 0


if __name__ == "__main__":
    sys.exit(main())
