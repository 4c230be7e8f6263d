"""How fast the DP planner solves: the issue's two targets, plus a scaling curve.

    python benchmarks/planner_bench.py [--out benchmarks/results/planner_bench.json] [--plot benchmarks/results/planner_bench.png]

1. One (B, M) solve for N = 8 nodes and L = 80 blocks (the paper's "under one millisecond"):
   ``bloombee.planner.solve`` including all of that (B, M)'s own work (block and hop times, the
   compute/memory table, the DP, the walk back), over several swarms and (B, M) pairs, both
   objectives (M = 1: sum, M > 1: bottleneck). Target <= 1 ms. The input's link matrices, derived
   once per input as ``plan`` does, are outside; ``median_ms_fresh_inputs_object`` includes them.
2. A full ``plan`` for N = 64, L = 160 over 6 batch sizes x 4 micro-batch counts, from a fresh
   inputs object. Target < 2 s.
3. Solve time against N (L = 2.5 N), for the plot.

Swarms come from ``examples/swarms.py`` (``swarm_inputs``: a mix of RTX 3090/4090/5090, L40S,
A100 and H100 machines on home and datacenter links, cost tables from their bandwidth and FLOPs).
Times are wall-clock medians (time.perf_counter) on this machine, with the process's CPU-time
medians beside them (less sensitive to other load); the CPU count and load average are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bloombee.planner import plan, solve
from bloombee.planner.costs import _static

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for examples/

from examples.swarms import swarm_inputs

HERE = Path(__file__).resolve().parent


def _median_seconds(fn, repeats: int, cpu: list | None = None, setup=None) -> float:
    """Median wall-clock seconds of fn(setup()) (setup untimed); the median CPU seconds of this
    process go to `cpu`."""
    setup = setup or (lambda: None)
    fn(setup())  # warm up
    times, cpu_times = [], []
    for _ in range(repeats):
        arg = setup()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(arg)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - start_cpu)
    if cpu is not None:
        cpu.append(statistics.median(cpu_times))
    return statistics.median(times)


def _fresh_per_b(inputs):
    """Forget what was derived per micro-batch size (block times, hop times), keep the per-input
    link matrices: every timed solve then does all of its (B, M)'s own work, as in ``plan``."""
    _static(inputs).per_b.clear()
    return inputs


def bench_single(repeats: int, seeds: int) -> dict:
    pairs = [(32, 1), (128, 1), (32, 2), (32, 4), (128, 8), (256, 4)]
    rows, cpu, cold = [], [], []
    for seed in range(seeds):
        inputs = swarm_inputs(seed, 8, 80)
        for batch, micro in pairs:
            t = _median_seconds(lambda x: solve(x, batch, micro), repeats, cpu, setup=lambda: _fresh_per_b(inputs))
            # fully cold: a new inputs object, so its link matrices are derived inside the timing too
            cold.append(_median_seconds(lambda x: solve(x, batch, micro), repeats, setup=inputs.model_copy))
            found = solve(inputs, batch, micro)
            rows.append(
                {
                    "seed": seed,
                    "batch_size": batch,
                    "micro_batches": micro,
                    "median_ms": t * 1e3,
                    "active_stages": found.num_active if found else None,
                }
            )
    sums = [r["median_ms"] for r in rows if r["micro_batches"] == 1]
    bottlenecks = [r["median_ms"] for r in rows if r["micro_batches"] > 1]
    every = [r["median_ms"] for r in rows]
    return {
        "nodes": 8,
        "blocks": 80,
        "median_ms": statistics.median(every),
        "median_cpu_ms": statistics.median(cpu) * 1e3,
        "median_ms_fresh_inputs_object": statistics.median(cold) * 1e3,
        "median_ms_sum_objective": statistics.median(sums),
        "median_ms_bottleneck_objective": statistics.median(bottlenecks),
        "max_case_median_ms": max(every),
        "target_ms": 1.0,
        "meets_target": statistics.median(every) <= 1.0,
        "cases": rows,
    }


def bench_full(repeats: int, seeds: int) -> dict:
    rows, cpu = [], []
    for seed in range(seeds):
        inputs = swarm_inputs(seed, 64, 160)
        t = _median_seconds(lambda x: plan(x), repeats, cpu, setup=inputs.model_copy)
        best = plan(inputs)
        rows.append(
            {
                "seed": seed,
                "median_s": t,
                "batch_size": best.batch_size,
                "micro_batches": best.micro_batches,
                "active_stages": best.evaluation.num_active,
                "throughput_tokens_per_s": best.throughput,
            }
        )
    every = [r["median_s"] for r in rows]
    return {
        "nodes": 64,
        "blocks": 160,
        "batch_sizes": list(swarm_inputs(0, 2, 4).workload.batch_sizes),
        "micro_batches": list(swarm_inputs(0, 2, 4).workload.micro_batches),
        "median_s": statistics.median(every),
        "median_cpu_s": statistics.median(cpu),
        "max_seed_median_s": max(every),
        "target_s": 2.0,
        "meets_target": statistics.median(every) < 2.0,
        "cases": rows,
    }


def bench_scaling(repeats: int) -> list[dict]:
    rows = []
    for nodes in (4, 8, 16, 32, 64, 96):
        blocks = int(2.5 * nodes) if nodes > 8 else 80
        inputs = swarm_inputs(100 + nodes, nodes, blocks)
        for micro in (1, 4):
            t = _median_seconds(lambda x: solve(x, 64, micro), repeats, setup=lambda: _fresh_per_b(inputs))
            rows.append({"nodes": nodes, "blocks": blocks, "batch_size": 64, "micro_batches": micro, "median_ms": t * 1e3})
    return rows


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for micro, label in ((1, "M = 1 (sum objective)"), (4, "M = 4 (bottleneck objective)")):
        rows = [r for r in results["scaling"] if r["micro_batches"] == micro]
        ax.plot([r["nodes"] for r in rows], [r["median_ms"] for r in rows], marker="o", label=label)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes N (L = 80 for N <= 8, else 2.5 N blocks)")
    ax.set_ylabel("one (B, M) solve, median ms")
    single, full = results["single_solve_n8_l80"], results["full_plan_n64_l160"]
    ax.set_title(
        f"N=8, L=80: {single['median_ms']:.2f} ms per (B, M);  N=64, L=160, 24 (B, M): {full['median_s']:.2f} s",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results" / "planner_bench.json"))
    parser.add_argument("--plot", nargs="?", const=str(HERE / "results" / "planner_bench.png"), default=None)
    parser.add_argument("--repeats", type=int, default=50, help="repeats per single-solve case")
    parser.add_argument("--full-repeats", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()

    load_before = os.getloadavg()
    started = time.perf_counter()
    results = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "load_average_before": load_before,
        },
        "single_solve_n8_l80": bench_single(args.repeats, args.seeds),
        "full_plan_n64_l160": bench_full(args.full_repeats, args.seeds),
        "scaling": bench_scaling(max(5, args.repeats // 5)),
    }
    results["machine"]["load_average_after"] = os.getloadavg()
    results["wall_seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    single, full = results["single_solve_n8_l80"], results["full_plan_n64_l160"]
    print(
        f"one (B, M) solve, N=8 L=80: median {single['median_ms']:.3f} ms (CPU {single['median_cpu_ms']:.3f} ms, "
        f"fresh inputs object {single['median_ms_fresh_inputs_object']:.3f} ms) "
        f"(sum {single['median_ms_sum_objective']:.3f}, bottleneck {single['median_ms_bottleneck_objective']:.3f}; "
        f"target 1 ms: {'met' if single['meets_target'] else 'MISSED'})"
    )
    print(
        f"full plan, N=64 L=160, 6 x 4 (B, M): median {full['median_s']:.3f} s (CPU {full['median_cpu_s']:.3f} s) "
        f"(target 2 s: {'met' if full['meets_target'] else 'MISSED'})"
    )
    print(f"load average {load_before} -> {results['machine']['load_average_after']}; wrote {out}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
