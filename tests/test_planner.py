"""The DP planner: exactness against brute force, the cost model, baselines, infeasibility, examples."""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from bloombee.planner import (
    PlanInfeasibleError,
    PlanInputs,
    baselines,
    brute_force,
    even_split,
    evaluate,
    greedy,
    plan,
    solve,
)
from bloombee.planner.brute import compositions
from bloombee.planner.costs import StepModel, block_times
from bloombee.planner.schedule import simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for examples/

from examples.swarms import swarm_inputs
from planner_problems import random_inputs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "plans"
GIB = 1 << 30


def _close(a, b):
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=1e-12)


@functools.lru_cache(maxsize=None)
def _brute(num_nodes: int, num_blocks: int, seed: int):
    inputs = random_inputs(seed * 1000 + num_nodes * 100 + num_blocks, num_nodes, num_blocks)
    try:
        return inputs, brute_force(inputs)
    except PlanInfeasibleError:
        return inputs, None


def _check_against_brute(num_nodes: int, num_blocks: int, seed: int) -> None:
    inputs, expected = _brute(num_nodes, num_blocks, seed)
    try:
        got = plan(inputs)
    except PlanInfeasibleError:
        got = None
    assert (got is None) == (expected is None), (num_nodes, num_blocks, seed)
    if got is None:
        return
    # the same optimum for every candidate (B, M), not just the best one
    assert len(got.candidates) == len(expected.candidates)
    for mine, theirs in zip(got.candidates, expected.candidates):
        assert (mine.batch_size, mine.micro_batches) == (theirs.batch_size, theirs.micro_batches)
        assert _close(mine.throughput, theirs.throughput), (mine, theirs)
    assert _close(got.throughput, expected.throughput)
    # the DP's assignment, re-scored by the evaluator, is what the DP claimed
    check = evaluate(inputs, got.assignment, got.batch_size, got.micro_batches)
    assert check.feasible and check.throughput == got.throughput


SMALL_CASES = [(n, l) for n in range(1, 5) for l in range(1, 11)]


@pytest.mark.parametrize("num_nodes,num_blocks", SMALL_CASES)
def test_dp_equals_brute_force(num_nodes, num_blocks):
    for seed in range(3):
        _check_against_brute(num_nodes, num_blocks, seed)


def test_random_generator_covers_the_interesting_cases():
    """The brute-force cases include skipped nodes, offloading, micro-batching, compression and infeasibility."""
    seen = set()
    for num_nodes, num_blocks in SMALL_CASES:
        for seed in range(3):
            _, result = _brute(num_nodes, num_blocks, seed)
            if result is None:
                seen.add("infeasible")
                continue
            ev = result.evaluation
            if 0 in result.assignment:
                seen.add("skip")
            if any(a > 0 for a in result.alphas):
                seen.add("offload")
            if result.micro_batches > 1:
                seen.add("micro-batches")
            if any(s.hop and s.hop.compressed for s in ev.stages) or ev.client_hop.compressed:
                seen.add("compression")
    assert seen == {"infeasible", "skip", "offload", "micro-batches", "compression"}


def test_compositions_enumerates_every_assignment():
    items = list(compositions(5, 3))
    assert len(items) == math.comb(7, 2) and len(set(items)) == len(items)
    assert all(sum(c) == 5 and min(c) >= 0 for c in items)


# ------------------------------------------------------------------------------------- cost model


def _node(name, gpu_gib=24.0, host_gib=64.0, mlp=1.0, attn_gpu=0.1, attn_cpu=1.0, up=1000.0, down=1000.0, lat=5.0, codec=None):
    return {
        "name": name,
        "gpu_memory_gib": gpu_gib,
        "host_memory_gib": host_gib,
        "reserved_gib": 1.0,
        "cost": {"coefficients": {"mlp_ms": [mlp], "attn_gpu_ms": [attn_gpu], "attn_cpu_ms": [attn_cpu]}},
        "link": {"uplink_mbps": up, "downlink_mbps": down, "latency_ms": lat},
        "compression": codec,
    }


def _inputs(nodes, blocks=12, weight_gib=1.0, kv_bytes=1 << 20, batch_sizes=(8,), micro=(1,), seq_len=128, **extra):
    data = {
        "model": {
            "num_blocks": blocks,
            "hidden_size": 4096,
            "weight_bytes_per_block": int(weight_gib * GIB),
            "kv_bytes_per_token_per_block": kv_bytes,
            "workspace_bytes_per_token": 0,
        },
        "workload": {"batch_sizes": list(batch_sizes), "micro_batches": list(micro), "seq_len": seq_len},
        "client": {"link": {"uplink_mbps": 1000.0, "downlink_mbps": 1000.0, "latency_ms": 5.0}},
        "nodes": nodes,
    }
    data.update(extra)
    return PlanInputs.model_validate(data)


def test_alpha_is_the_smallest_offload_that_fits():
    # 10 blocks of 1 GiB + 1 GiB reserved on a 16 GiB GPU leave 5 GiB for KV; KV = 10 * 8 * 128 * 1 MiB = 10 GiB
    inputs = _inputs([_node("a", gpu_gib=16.0)], blocks=10)
    ev = evaluate(inputs, [10], 8, 1)
    assert ev.feasible
    assert ev.stages[0].alpha == pytest.approx(0.5)
    assert ev.stages[0].gpu_used_bytes == pytest.approx(16 * GIB)
    history = 8 * 128 * (inputs.model.activation_bytes(inputs.workload.dtype) + 1)  # output history and token mask
    assert ev.stages[0].host_used_bytes == pytest.approx(5 * GIB + history)
    # T_comp = L * (t_mlp + (1 - alpha) t_gpu + alpha t_cpu)
    assert ev.stages[0].t_comp_s == pytest.approx(10 * (1.0 + 0.5 * 0.1 + 0.5 * 1.0) * 1e-3)


def test_infeasible_assignment_names_the_node_and_the_constraint():
    inputs = _inputs([_node("small", gpu_gib=4.0), _node("nohost", gpu_gib=12.0, host_gib=0.5)], blocks=10)
    ev = evaluate(inputs, [5, 5], 8, 1)
    assert not ev.feasible
    assert "node 'small'" in ev.reason and "GPU memory" in ev.reason
    ev = evaluate(inputs, [0, 10], 8, 1)
    assert not ev.feasible and "node 'nohost'" in ev.reason and "host memory" in ev.reason
    with pytest.raises(ValueError, match="sums to"):
        evaluate(inputs, [1, 2], 8, 1)
    with pytest.raises(ValueError, match="entries"):
        evaluate(inputs, [10], 8, 1)
    assert "exceeds batch_size" in evaluate(inputs, [5, 5], 2, 4).reason


def test_step_time_formulas():
    nodes = [_node("a", mlp=2.0), _node("b", mlp=1.0), _node("c", mlp=3.0)]
    inputs = _inputs(nodes, blocks=6, batch_sizes=(8,), micro=(1, 4))
    no_mb = evaluate(inputs, [2, 0, 4], 8, 1)
    hops = [no_mb.client_hop.time_s] + [s.t_comm_s for s in no_mb.active_stages]
    comps = [s.t_comp_s for s in no_mb.active_stages]
    assert no_mb.num_active == 2 and not no_mb.stages[1].active
    assert no_mb.stages[0].hop.dst == "c" and no_mb.stages[2].hop.dst == "client"  # b is skipped with its hops
    assert no_mb.step_time_s == pytest.approx(sum(hops) + sum(comps))
    assert no_mb.throughput == pytest.approx(8 / no_mb.step_time_s)
    mb = evaluate(inputs, [2, 0, 4], 8, 4)
    cycle = max([mb.client_hop.time_s] + [max(s.t_comp_s, s.t_comm_s) for s in mb.active_stages])
    assert mb.cycle_s == cycle
    assert mb.step_time_s == pytest.approx(_trip(mb) + (4 - 1) * cycle)  # one micro-batch's trip, then one per cycle
    # the simulated schedule of M = 1 is the plain sum, of M = 4 (no shared cores) the same closed form but for the
    # acknowledgements that wait behind a node's own upload
    assert simulate(no_mb)[1] == pytest.approx(no_mb.step_time_s)
    assert simulate(mb)[1] == pytest.approx(mb.step_time_s, rel=0.02)


def test_hop_bandwidth_latency_overrides_and_compression_rule():
    codec = {"ratio": 1.5, "compress_mb_per_s": 200.0, "decompress_mb_per_s": 800.0}
    nodes = [_node("a", up=100.0, down=50.0, lat=3.0, codec=codec), _node("b", up=20.0, down=400.0, lat=7.0, codec=codec)]
    inputs = _inputs(
        nodes,
        blocks=4,
        link_overrides=[{"src": "b", "dst": "client", "bandwidth_mbps": 1000.0, "latency_ms": 1.0}],
        link_matrix={"names": ["a", "b"], "latency_ms": [[None, 2.0], [None, None]]},
    )
    model = StepModel(inputs, 8, 1)
    n_bytes = 8 * 4096 * 2
    a, b, client = 0, 1, 2
    # a -> b: min(100 up, 400 down) Mbps, latency from the matrix
    assert model.hop_bandwidth_mbps[a, b] == 100.0 and model.hop_latency_s[a, b] == pytest.approx(2e-3)
    # client -> a: min(1000, 50), 5 + 3 ms
    assert model.hop_bandwidth_mbps[client, a] == 50.0 and model.hop_latency_s[client, a] == pytest.approx(8e-3)
    assert model.hop_bandwidth_mbps[b, client] == 1000.0 and model.hop_latency_s[b, client] == pytest.approx(1e-3)
    for src in range(3):
        for dst in range(3):
            if src == dst:
                continue
            rate = model.hop_bandwidth_mbps[src, dst] * 1e6 / 8
            has_codecs = src != client and dst != client  # the client has no codec here
            pays = (1 - 1 / 1.5) / rate > 1 / 200e6 + 1 / 800e6
            assert model.hop_compressed[src, dst] == (has_codecs and pays)
            raw = model.hop_latency_s[src, dst] + n_bytes / rate
            packed = model.hop_latency_s[src, dst] + n_bytes / (1.5 * rate) + n_bytes / 200e6 + n_bytes / 800e6
            assert model.hop[src, dst] == pytest.approx(packed if model.hop_compressed[src, dst] else raw)
    assert model.hop_compressed[b, a]  # 20 Mbps: pays
    assert not model.hop_compressed[a, b] or (1 - 1 / 1.5) / (100e6 / 8) > 1 / 200e6 + 1 / 800e6


def test_the_codec_calls_own_time_keeps_small_activations_raw():
    """With a codec's per-message call time a hop compresses a prompt-sized activation but not a decode step's."""
    codec = {"ratio": 1.5, "compress_mb_per_s": 500.0, "decompress_mb_per_s": 500.0, "call_ms": 0.06}
    nodes = [_node("a", up=480, down=480, codec=codec), _node("b", up=480, down=480, codec=codec)]
    inputs = _inputs(nodes, blocks=4)
    for rows, expected in ((1, False), (512, True)):
        model = StepModel(inputs, rows, 1)
        n_bytes, rate = rows * 4096 * 2, 480e6 / 8
        packed = model.hop_latency_s[0, 1] + n_bytes / (1.5 * rate) + 2 * n_bytes / 500e6 + 0.06e-3
        assert bool(model.hop_compressed[0, 1]) is expected
        assert model.hop[0, 1] == pytest.approx(min(packed, model.hop_latency_s[0, 1] + n_bytes / rate))


def test_compression_modes():
    codec = {"ratio": 1.3, "compress_mb_per_s": 300.0, "decompress_mb_per_s": 1000.0}
    nodes = [_node("a", up=10000, down=10000, codec=codec), _node("b", up=10000, down=10000, codec=codec)]
    for mode, expected in (("auto", False), ("on", True), ("off", False)):
        inputs = _inputs(nodes, blocks=4)
        inputs = PlanInputs.model_validate(
            {**inputs.model_dump(), "workload": {**inputs.workload.model_dump(), "compression": mode}}
        )
        assert bool(StepModel(inputs, 8, 1).hop_compressed[0, 1]) is expected


def test_cost_table_interpolation_and_seq_len_scaling():
    node = _node("a")
    node["cost"] = {
        "table": {"micro_batch": [2, 4, 8], "mlp_ms": [1.0, 2.0, 4.0], "attn_gpu_ms": [0.5, 1.0, 2.0], "attn_cpu_ms": [1, 2, 3]},
        "reference_seq_len": 64,
    }
    cost = _inputs([node]).nodes[0].cost
    assert block_times(cost, 3, 64) == pytest.approx((1.5e-3, 0.75e-3, 1.5e-3))
    assert block_times(cost, 1, 64) == pytest.approx((1e-3, 0.5e-3, 1e-3))  # below the table: first entry
    assert block_times(cost, 16, 64) == pytest.approx((8e-3, 4e-3, 5e-3))  # above: last segment extended
    assert block_times(cost, 4, 256) == pytest.approx((2e-3, 4e-3, 8e-3))  # attention x 256 / 64


# ------------------------------------------------------------------------------------- planning


def test_slow_compute_node_gets_fewer_blocks_or_none():
    nodes = [_node("a", mlp=1.0), _node("slow", mlp=20.0), _node("c", mlp=1.0)]
    for micro in ((1,), (4,)):
        result = plan(_inputs(nodes, blocks=30, micro=micro))
        a, slow, c = result.assignment
        assert slow < min(a, c), result.assignment


def test_node_behind_slow_link_is_skipped():
    nodes = [_node("a"), _node("dialup", up=1.0, down=1.0, lat=200.0), _node("c")]
    for micro in ((1,), (4,)):
        result = plan(_inputs(nodes, blocks=20, micro=micro))
        assert result.assignment[1] == 0
        assert result.evaluation.stages[0].hop.dst == "c"


def test_plan_beats_or_matches_baselines_and_picks_best_candidate():
    inputs = swarm_inputs(3, 10, 40, batch_sizes=(8, 32), micro_batches=(1, 2, 4))
    best = plan(inputs)
    others = baselines(inputs)
    for result in others.values():
        if result.evaluation is not None:
            assert best.throughput >= result.throughput * (1 - 1e-12)
    feasible = [c.throughput for c in best.candidates if c.throughput is not None]
    assert best.throughput == max(feasible)
    assert sum(best.assignment) == 40 and len(best.alphas) == 10


def test_baseline_assignments():
    inputs = _inputs([_node("a"), _node("b"), _node("c")], blocks=10)
    assert even_split(inputs) == [4, 3, 3]
    # greedy without offloading: capacity (24 - 1) GiB / (1 GiB + 8 * 128 * 1 MiB = 1 GiB) = 11 blocks each
    assignment, reason = greedy(inputs, 8)
    assert reason == "" and assignment == [10, 0, 0]
    tight = _inputs([_node("a", gpu_gib=6.0), _node("b", gpu_gib=6.0)], blocks=10)
    assignment, reason = greedy(tight, 8)
    assert assignment is None and "without a server" in reason


def test_solve_returns_none_when_nothing_fits():
    inputs = _inputs([_node("a", gpu_gib=2.0, host_gib=0.0)], blocks=10)
    assert solve(inputs, 8, 1) is None and solve(inputs, 8, 16) is None


def test_model_that_fits_nowhere_says_which_constraint_binds():
    gpu_bound = _inputs([_node("a", gpu_gib=1.5), _node("b", gpu_gib=1.8)], blocks=10, weight_gib=2.0)
    with pytest.raises(PlanInfeasibleError) as err:
        plan(gpu_bound)
    message = str(err.value)
    assert "GPU memory" in message and "a: 0" in message and "b: 0" in message and "0 of the 10 blocks" in message
    assert "one block's weights" in message

    host_bound = _inputs([_node("a", gpu_gib=12.0, host_gib=1.0), _node("b", gpu_gib=12.0, host_gib=1.0)], blocks=20)
    with pytest.raises(PlanInfeasibleError) as err:
        plan(host_bound)
    assert "host memory" in str(err.value)
    with pytest.raises(PlanInfeasibleError):
        brute_force(host_bound)


@pytest.mark.parametrize("name", ["e1", "e2", "e3", "e4", "e5", "e6"])
def test_example_scenarios_plan(name):
    inputs = PlanInputs.from_file(EXAMPLES / f"{name}.yaml")
    assert inputs.model.num_blocks == 60 and inputs.model.name == "llama-30b"
    best = plan(inputs)
    assert sum(best.assignment) == 60 and best.throughput > 0
    for result in baselines(inputs).values():
        if result.evaluation is not None:
            assert best.throughput >= result.throughput * (1 - 1e-12)


def test_examples_show_the_papers_trends():
    """Lower bandwidth: lower throughput, micro-batching and compression; E5 drops a node by offloading KV."""
    results = {name: plan(PlanInputs.from_file(EXAMPLES / f"{name}.yaml")) for name in ("e1", "e2", "e3", "e4", "e5")}
    values = [results[name].throughput for name in ("e1", "e2", "e3", "e4", "e5")]
    assert values == sorted(values, reverse=True)
    e5 = results["e5"]
    assert e5.micro_batches > 1 and 0 in e5.assignment and max(e5.alphas) > 0
    assert all(s.hop.compressed for s in e5.evaluation.active_stages)
    assert not any(s.hop.compressed for s in results["e1"].evaluation.active_stages)


def test_swarm_generator_is_deterministic():
    a, b = swarm_inputs(1, 5, 20), swarm_inputs(1, 5, 20)
    assert a == b
    assert np.isfinite(plan(a).throughput)


def _trip(evaluation) -> float:
    return evaluation.client_hop.time_s + sum(s.t_comp_s + s.t_comm_s for s in evaluation.active_stages)


@pytest.mark.parametrize("seed", range(20))
def test_lean_comp_table_matches_stage_arrays(seed):
    inputs = random_inputs(seed + 300, 1 + seed % 5, 1 + seed % 13)
    for batch in inputs.workload.batch_sizes:
        for micro in inputs.workload.micro_batches:
            model = StepModel(inputs, batch, micro)
            comp, caps = model.comp_table()
            full = model.table()
            assert np.array_equal(comp, full.comp)
            assert np.array_equal(caps, model.capacity(full))


def test_the_closed_form_and_the_event_simulation_agree_on_a_grid_of_chains():
    """The DP's closed form (trip + (M - 1) x cycle) is the flow shop the simulation runs; the simulation adds only
    the acknowledgements that wait behind a node's own upload. On random chains (no shared cores) it is never faster
    than the closed form and at most 20 % slower (eq. 4's (M + N' - 1) x cycle was up to 2x off)."""
    ratios = []
    for seed in range(40):
        inputs = random_inputs(seed + 700, 1 + seed % 4, 2 + seed % 7)
        for batch in inputs.workload.batch_sizes:
            for micro in (m for m in (1, 2, 4, 8) if m <= batch):
                for assignment in compositions(inputs.num_blocks, len(inputs.nodes)):
                    ev = evaluate(inputs, assignment, batch, micro)
                    if ev.feasible:
                        ratios.append(simulate(ev)[1] / ev.step_time_s)
    assert len(ratios) > 300
    assert 1 - 1e-9 <= min(ratios) and max(ratios) <= 1.2
