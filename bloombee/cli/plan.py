"""`bloombee-plan`: the pipeline planner.

    bloombee-plan --nodes nodes.yaml [--model MODEL] [--batch-sizes 16 32 64] [--micro-batches 1 2 4]
                  [--seq-len 512] [--dtype float16] [--compression auto|on|off] [--json] [--plot plan.png]

The input file (YAML or JSON, see bloombee/planner/README.md and examples/plans/) holds the nodes in
pipeline order, the client, optional link overrides, and optionally the model and the workload.
``--model`` (an alias, hub id or local folder) replaces the file's model section with shapes read
from the model's config; the workload flags replace the file's values.

Prints the chosen plan as a table (or JSON with --json) with the even-split and greedy baselines.
Exit status: 0 planned, 1 no feasible plan, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from bloombee.planner import PlanInfeasibleError, PlanInputError, PlanInputs, baselines, plan
from bloombee.planner.inputs import read_input_file
from bloombee.planner.model_config import ModelConfigError, load_model_section
from bloombee.planner.report import json_report, text_report
from bloombee.planner.schedule import plot_schedule, simulate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bloombee-plan",
        description="Plan block ranges, KV offload, batch size and micro-batches for a BloomBee pipeline.",
    )
    parser.add_argument("--nodes", "--input", dest="input", required=True, help="YAML/JSON planner input file")
    parser.add_argument("--model", help="model alias, hub id or local folder; replaces the file's model section")
    parser.add_argument("--batch-sizes", type=int, nargs="+", metavar="B", help="candidate batch sizes")
    parser.add_argument("--micro-batches", type=int, nargs="+", metavar="M", help="candidate micro-batch counts")
    parser.add_argument("--seq-len", type=int, help="context length s the KV cache is sized for")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--compression", choices=["auto", "on", "off"])
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", metavar="PNG", help="draw the micro-batch schedule of one step")
    return parser


def load_inputs(args: argparse.Namespace) -> PlanInputs:
    raw = read_input_file(args.input)
    if args.model:
        raw["model"] = load_model_section(args.model)
    workload: dict[str, Any] = {}
    for flag, key in (
        ("batch_sizes", "batch_sizes"),
        ("micro_batches", "micro_batches"),
        ("seq_len", "seq_len"),
        ("dtype", "dtype"),
        ("compression", "compression"),
    ):
        value = getattr(args, flag)
        if value is not None:
            workload[key] = value
    if "model" not in raw:
        raise PlanInputError(f"invalid planner input ({args.input}):\n  model: give --model or a `model:` section")
    return PlanInputs.from_dict(raw, overrides={"workload": workload} if workload else None, source=args.input)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        inputs = load_inputs(args)
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
    simulated = None
    if args.plot:
        simulated = plot_schedule(best.evaluation, args.plot)
    else:
        simulated = simulate(best.evaluation)[1]
    if args.json:
        report = json_report(inputs, best, others, simulated)
        report["feasible"] = True
        if args.plot:
            report["plot"] = args.plot
        print(json.dumps(report, indent=2))
    else:
        print(text_report(inputs, best, others, simulated))
        if args.plot:
            print(f"schedule plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
