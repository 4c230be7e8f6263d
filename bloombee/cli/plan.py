"""`bloombee-plan`: the pipeline planner.

    bloombee-plan --nodes nodes.yaml [--model MODEL] [--batch-sizes 16 32 64] [--micro-batches 1 2 4]
                  [--seq-len 512] [--dtype float16] [--compression auto|on|off] [--quant none,int8,nf4]
                  [--json] [--plot plan.png]
    bloombee-plan --measure --model MODEL [--name NAME] [--device cpu] [--measure-sizes 1 4 16] [--quant ...]
                  >> nodes.yaml

The input file (YAML or JSON, see bloombee/planner/README.md and examples/plans/) holds the nodes in
pipeline order, the client, optional link overrides, and optionally the model and the workload.
``--model`` (an alias, hub id or local folder) replaces the file's model section with shapes read
from the model's config; the workload flags replace the file's values.

Prints the chosen plan as a table (or JSON with --json) with the even-split and greedy baselines;
with more than one ``--quant`` precision also the best plan with each alone, side by side.
``--measure`` instead times one block of the model on this machine and prints this machine as a
node of nodes.yaml (per-block cost table, memory, codec), ready to paste (docs/planner.md).
Exit status: 0 planned (or measured), 1 no feasible plan, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any, Sequence

import yaml

from bloombee.cli.common import ArgumentParser, add_common_flags, parse_args, setup_logging
from bloombee.planner import PlanInfeasibleError, PlanInputError, PlanInputs, baselines, evaluate, plan
from bloombee.planner.inputs import read_input_file
from bloombee.planner.model_config import ModelConfigError, load_model_section
from bloombee.planner.placement import current_assignment
from bloombee.planner.report import json_report, plot_title, simulated_throughput, text_report
from bloombee.planner.schedule import cpu_shares, plot_schedule, simulate
from bloombee.weight_formats import QUANT_TYPES, parse_quant_types


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="bloombee-plan",
        description="Plan block ranges, KV offload, batch size and micro-batches for a BloomBee pipeline.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--nodes", "--input", dest="input", help="YAML/JSON planner input file")
    source.add_argument("--initial-peers", nargs="+",
                        help="plan for the live swarm from the profiles its online servers announce (every server "
                             "measures and announces one unless started with --no-profile)")
    source.add_argument("--measure", action="store_true",
                        help="time one block of --model on this machine and print it as a nodes.yaml node (YAML) "
                             "instead of planning: the per-block cost table in ms a hand-written nodes.yaml needs")
    parser.add_argument("--client-uplink-mbps", type=float, default=100.0, help="with --initial-peers: the client's uplink, Mbit/s (default: %(default)s)")
    parser.add_argument("--client-downlink-mbps", type=float, default=100.0,
                        help="with --initial-peers: the client's downlink, Mbit/s (default: %(default)s)")
    parser.add_argument("--client-latency-ms", type=float, default=10.0,
                        help="with --initial-peers: the client's one-way latency, ms (default: %(default)s)")
    parser.add_argument("--model", help="model alias, hub id or local folder; replaces the file's model section (default: the file's)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", metavar="B", help="candidate batch sizes, sequences (default: the file's, else the planner's)")
    parser.add_argument("--micro-batches", type=int, nargs="+", metavar="M", help="candidate micro-batch counts (default: the file's, else the planner's)")
    parser.add_argument("--seq-len", type=int,
                        help="context length s the KV cache is sized for, tokens (default: the file's; with --measure "
                             "the context its attention is timed over, default 32)")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                        help="dtype of weights and activations (default: the file's; with --measure the checkpoint's)")
    parser.add_argument("--compression", choices=["auto", "on", "off"],
                        help="compress hops: auto (where it saves time), on or off (default: the file's, else auto)")
    parser.add_argument("--quant", type=quant_list, metavar="TYPES",
                        help=f"weight precisions the planner may give a node, comma-separated, of "
                             f"{', '.join(QUANT_TYPES)} (default: the file's, else none); with --measure, also time a "
                             "block in each")
    measure = parser.add_argument_group("with --measure")
    measure.add_argument("--name", help="the node's name (default: this machine's host name)")
    measure.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N to time the block on (default: %(default)s)")
    measure.add_argument("--measure-sizes", type=int, nargs="+", metavar="ROWS",
                         help="micro-batch sizes to time, rows (default: the sizes servers profile)")
    measure.add_argument("--link-mbps", type=float, default=100.0,
                         help="this machine's link speed written into the node, Mbit/s (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", metavar="PNG", help="draw the micro-batch schedule of one step")
    add_common_flags(parser, default_level="warning")
    return parser


def quant_list(text: str) -> list[str]:
    """argparse type: 'none,nf4' -> ['none', 'nf4']."""
    try:
        return list(parse_quant_types(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def swarm_input(args: argparse.Namespace) -> tuple[dict[str, Any], list[tuple[str, int, int]]]:
    """A planner input from the live swarm's DHT records, and the servers' current ranges."""
    if not args.model:
        raise PlanInputError("--initial-peers needs --model (the model whose servers to plan for)")
    from bloombee.client.placement import swarm_dtype, swarm_nodes
    from bloombee.dht.peers import start_dht
    from bloombee.dht.records import fetch_records
    from bloombee.loading import dht_prefix

    model = load_model_section(args.model)
    dht = start_dht(args.initial_peers, client_mode=True)
    try:
        servers = {}
        for records in fetch_records(dht, dht_prefix(args.model), model["num_blocks"]):
            servers.update(records)
    finally:
        dht.shutdown()
    nodes, ranges = swarm_nodes(servers)
    if not nodes:
        raise PlanInputError(f"no online server of {args.model} announces a profile ({len(servers)} servers found); "
                             "restart the servers without --no-profile")
    link = {"uplink_mbps": args.client_uplink_mbps, "downlink_mbps": args.client_downlink_mbps, "latency_ms": args.client_latency_ms}
    return {"model": model, "workload": {"dtype": swarm_dtype(servers)}, "client": {"link": link}, "nodes": nodes}, ranges


def load_inputs(args: argparse.Namespace, raw: dict[str, Any] | None = None) -> PlanInputs:
    raw = read_input_file(args.input) if raw is None else raw
    if args.model and args.input:
        raw["model"] = load_model_section(args.model)
    workload: dict[str, Any] = {}
    for flag, key in (
        ("batch_sizes", "batch_sizes"),
        ("micro_batches", "micro_batches"),
        ("seq_len", "seq_len"),
        ("dtype", "dtype"),
        ("compression", "compression"),
        ("quant", "quant"),
    ):
        value = getattr(args, flag)
        if value is not None:
            workload[key] = value
    if "model" not in raw:
        raise PlanInputError(f"invalid planner input ({args.input}):\n  model: give --model or a `model:` section")
    return PlanInputs.from_dict(raw, overrides={"workload": workload} if workload else None, source=args.input or "the swarm")


def current_layout(inputs: PlanInputs, ranges: list[tuple[str, int, int]], best, cpus) -> dict[str, Any]:
    """The swarm's current assignment scored by the same model as the plan (or why it cannot be)."""
    assignment, reason = current_assignment(ranges, inputs.model.num_blocks)
    if assignment is None:
        return {"assignment": None, "reason": reason}
    evaluation = evaluate(inputs, assignment, best.batch_size, best.micro_batches)
    throughput = simulated_throughput(evaluation, simulate(evaluation, cpus)[1]) if evaluation.feasible else None
    return {"assignment": assignment, "feasible": evaluation.feasible, "reason": evaluation.reason,
            "throughput_tokens_per_s": throughput}


def current_text(current: dict[str, Any], best, cpus) -> str:
    """One line comparing the swarm's current layout with the plan, both over their simulated steps."""
    estimate = current.get("throughput_tokens_per_s")
    if not estimate:
        return f"current swarm layout {current['assignment']}: {current['reason']}"
    planned = simulated_throughput(best.evaluation, simulate(best.evaluation, cpus)[1])
    return f"current swarm layout {current['assignment']}: {estimate:.1f} tokens/s (plan: {planned:.1f})"


def measured_node(args: argparse.Namespace) -> str:
    """This machine as a nodes.yaml node (YAML), timed on one block of --model."""
    if not args.model:
        raise PlanInputError("--measure needs --model (the model whose block to time)")
    import torch

    from bloombee.server.profile import MICRO_BATCHES, measure_node

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise PlanInputError(f"--device {args.device}: torch sees no CUDA GPU on this machine; measure with --device cpu")

    node = measure_node(args.model, args.name or socket.gethostname(), device=args.device, dtype=args.dtype or "auto",
                        seq_len=args.seq_len or 32, micro_batches=tuple(args.measure_sizes or MICRO_BATCHES),
                        link_mbps=args.link_mbps, quant_types=tuple(args.quant or ("none",)))
    header = (f"# {node['name']} timed on one block of {args.model} ({node['gpu']}) by bloombee-plan --measure;\n"
              "# paste the entry under `nodes:` of nodes.yaml and set its link to the machine's uplink, downlink and latency\n")
    return header + yaml.dump({"nodes": [_rounded(node)]}, Dumper=_PlainDumper, sort_keys=False)


class _PlainDumper(yaml.SafeDumper):
    """YAML without anchors and aliases: a node entry a person reads and edits."""

    def ignore_aliases(self, data) -> bool:
        return True


def _rounded(value: Any) -> Any:
    """Floats to 4 significant digits (more than a timing repeats to), in nested dicts and lists."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    setup_logging(args.log_level)
    if args.measure:
        try:
            print(measured_node(args), end="")
        except (PlanInputError, ModelConfigError, FileNotFoundError) as exc:
            print(f"bloombee-plan: {exc}", file=sys.stderr)
            return 2
        return 0
    ranges = None
    try:
        raw = None
        if args.initial_peers:
            raw, ranges = swarm_input(args)
        inputs = load_inputs(args, raw)
    except (PlanInputError, ModelConfigError) as exc:
        print(f"bloombee-plan: {exc}", file=sys.stderr)
        return 2
    try:
        best = plan(inputs)
    except PlanInfeasibleError as exc:
        if args.json:
            print(json.dumps({"feasible": False, "reason": str(exc)}, indent=2))
        print(f"bloombee-plan: {exc}", file=sys.stderr)
        return 1
    others = baselines(inputs)
    cpus = cpu_shares(inputs)
    if args.plot:
        plot_schedule(best.evaluation, args.plot, plot_title(best.evaluation, simulate(best.evaluation, cpus)[1]), cpus)
    current = current_layout(inputs, ranges, best, cpus) if ranges is not None else None
    if args.json:
        report = json_report(inputs, best, others, cpus)
        report["feasible"] = True
        if args.plot:
            report["plot"] = args.plot
        if current is not None:
            report["current"] = current
        print(json.dumps(report, indent=2))
        return 0
    print(text_report(inputs, best, others, cpus))
    if current is not None:
        print(current_text(current, best, cpus))
    if args.plot:
        print(f"schedule plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
