"""Weight precision as a planner decision: block sizes per precision, the per-node choice, the plan and the CLI."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from bloombee.cli.plan import main
from bloombee.planner import PlanInfeasibleError, PlanInputError, PlanInputs, brute_force, evaluate, plan
from bloombee.planner.model_config import model_section_from_config
from bloombee.planner.placement import node_quant_type, node_range
from bloombee.planner.report import json_report
from bloombee.weight_formats import linear_weight_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_problems import random_inputs

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "bloombee" / "assets" / "bloombee-tiny"
GIB = 1 << 30


def _tiny_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(TINY)


# ------------------------------------------------------------------------------------- block sizes


def test_quantised_block_bytes_of_the_tiny_model():
    section = model_section_from_config(_tiny_config())
    spec = PlanInputs.model_validate(_problem(2, 8, quant=["none"], model=section)).model
    full = spec.weight_bytes("float32")
    linear, rows = section["linear_params_per_block"], section["linear_rows_per_block"]
    rest = section["params_per_block"] - linear
    for quant, most in (("int8", 0.30), ("nf4", 0.16)):
        size = spec.weight_bytes("float32", quant)
        assert size == rest * 4 + linear_weight_bytes(linear, rows, quant, 4)
        assert size <= most * full
    assert spec.weight_bytes("float16", "none") == 2 * section["params_per_block"]


def test_explicit_weight_bytes_scale_their_linear_part():
    model = {"num_blocks": 4, "hidden_size": 64, "weight_bytes_per_block": 10_000, "kv_bytes_per_token_per_block": 64,
             "linear_params_per_block": 4_000, "linear_rows_per_block": 100}
    spec = PlanInputs.model_validate(_problem(1, 4, model=model)).model
    assert spec.weight_bytes("float16", "int8") == 10_000 - 8_000 + 4_000 + 4 * 100
    assert spec.weight_bytes("float16", "nf4") == 10_000 - 8_000 + linear_weight_bytes(4_000, 100, "nf4", 2)


def test_quantised_planning_needs_the_linear_share():
    model = {"num_blocks": 4, "hidden_size": 64, "params_per_block": 1000, "num_key_value_heads": 1, "head_dim": 8}
    with pytest.raises(PlanInputError, match="model.linear_params_per_block: the model section needs"):
        PlanInputs.from_dict(_problem(1, 4, quant=["none", "nf4"], model=model))
    with pytest.raises(PlanInputError, match="model.linear_rows_per_block"):
        PlanInputs.from_dict(_problem(1, 4, quant=["int8"], model={**model, "linear_params_per_block": 800}))
    fixed = _problem(1, 4, model=model)
    fixed["nodes"][0]["quant_type"] = "nf4"
    with pytest.raises(PlanInputError, match="to plan quantised \\(nf4\\) nodes"):
        PlanInputs.from_dict(fixed)
    spec = PlanInputs.from_dict(_problem(1, 4, model=model)).model
    with pytest.raises(PlanInputError, match="linear_params_per_block"):
        spec.weight_bytes("float16", "nf4")
    with pytest.raises(PlanInputError, match="model.linear_params_per_block: exceeds params_per_block"):
        PlanInputs.from_dict(_problem(1, 4, model={**model, "linear_params_per_block": 1001}))
    with pytest.raises(PlanInputError, match="workload.quant"):
        PlanInputs.from_dict(_problem(1, 4, quant=["fp3"], model=model))
    assert PlanInputs.from_dict(_problem(1, 4, quant=["nf4", "none", "nf4"], model={
        **model, "linear_params_per_block": 800})).workload.quant == ["none", "nf4"]


# ------------------------------------------------------------------------------------- planning


def _node(name, gpu_gib=4.0, mlp=1.0, **extra):
    return {"name": name, "gpu_memory_gib": gpu_gib, "host_memory_gib": 1.0, "reserved_gib": 0.5,
            "cost": {"coefficients": {"mlp_ms": [mlp], "attn_gpu_ms": [0.1], "attn_cpu_ms": [1.0]}},
            "link": {"uplink_mbps": 100.0, "downlink_mbps": 100.0, "latency_ms": 20.0}, **extra}


def _problem(num_nodes, blocks, quant=("none",), model=None, nodes=None):
    """1 GiB of float16 weights per block, 98 % of them in nn.Linear layers, and a small KV cache."""
    params = GIB // 2
    return {
        "model": model or {"name": "m", "num_blocks": blocks, "hidden_size": 4096, "params_per_block": params,
                           "linear_params_per_block": int(params * 0.98), "linear_rows_per_block": 3 * 4096,
                           "kv_bytes_per_token_per_block": 1024, "workspace_bytes_per_token": 0},
        "workload": {"batch_sizes": [4], "micro_batches": [1], "seq_len": 128, "quant": list(quant)},
        "client": {"link": {"uplink_mbps": 100.0, "downlink_mbps": 100.0, "latency_ms": 20.0}},
        "nodes": nodes or [_node(f"n{i}") for i in range(num_nodes)],
    }


def test_only_nf4_holds_the_model_on_fewer_nodes():
    """Two 4 GiB nodes hold 3 float16 blocks each, not 10; in nf4 one node holds all 10: one hop fewer."""
    with pytest.raises(PlanInfeasibleError, match="GPU memory"):
        plan(PlanInputs.model_validate(_problem(2, 10)))
    inputs = PlanInputs.model_validate(_problem(2, 10, quant=["none", "nf4"]))
    best = plan(inputs)
    assert best.evaluation.num_active == 1 and best.quant_types == ["nf4", None]
    stage = best.evaluation.stages[0]
    assert stage.quant_type == "nf4" and stage.weight_bytes == 10 * inputs.model.weight_bytes("float16", "nf4")
    assert stage.borrowed_cost  # no quant_costs.nf4: timed by its own cost
    report = json.loads(json.dumps(json_report(inputs, best, {})))
    assert report["plan"]["quant_types"] == ["nf4", None]
    assert node_quant_type(report, "n0") == "nf4" and node_range(report, "n0") == (0, 10, 0.0)
    with pytest.raises(ValueError, match="gives node 'n1' no blocks"):
        node_quant_type(report, "n1")
    with pytest.raises(ValueError, match="not in the plan"):
        node_quant_type(report, "z")
    rows = report["precision_comparison"]
    assert [row["quant"] for row in rows] == [["none"], ["nf4"], ["none", "nf4"]]
    assert not rows[0]["feasible"] and "GPU memory" in rows[0]["reason"]
    assert rows[1]["hops"] == rows[2]["hops"] == 2 and rows[2]["quant_types"] == {"n0": "nf4"}


def test_more_nodes_in_float16_fewer_in_nf4():
    """Three nodes hold 9 float16 blocks: three stages and four hops; in nf4 one stage and two hops."""
    none = plan(PlanInputs.model_validate(_problem(3, 9)))
    both = plan(PlanInputs.model_validate(_problem(3, 9, quant=["none", "nf4"])))
    assert none.evaluation.num_active == 3 and set(none.quant_types) == {"none"}
    assert both.evaluation.num_active == 1 and both.throughput > none.throughput


def test_a_precision_that_buys_nothing_is_not_used():
    """Where float16 fits as fast, the plan keeps it: ties go to the most precise precision."""
    inputs = PlanInputs.model_validate(_problem(1, 2, quant=["none", "int8", "nf4"]))
    assert plan(inputs).quant_types == ["none"]
    faster = _problem(1, 2, quant=["none", "int8"])
    faster["nodes"][0]["quant_costs"] = {"int8": {"coefficients": {"mlp_ms": [0.5], "attn_gpu_ms": [0.1],
                                                                   "attn_cpu_ms": [1.0]}}}
    best = plan(PlanInputs.model_validate(faster))
    assert best.quant_types == ["int8"] and not best.evaluation.stages[0].borrowed_cost


def test_a_node_fixed_in_a_precision_keeps_it():
    nodes = [_node("a", gpu_gib=40.0, quant_type="int8"), _node("b", gpu_gib=40.0)]
    for quant in (["none"], ["nf4"], ["none", "nf4"]):
        inputs = PlanInputs.model_validate(_problem(2, 6, quant=quant, nodes=nodes))
        for assignment in ([6, 0], [3, 3]):
            ev = evaluate(inputs, assignment, 4, 1)
            assert ev.feasible and ev.stages[0].quant_type == "int8"
            assert ev.stages[1].quant_type in ([None] if assignment[1] == 0 else quant)
            assert not ev.stages[0].borrowed_cost  # its own cost is its int8 cost


def test_node_quant_type_of_an_older_plan_is_none():
    report = {"nodes": ["a"], "plan": {"assignment": [4], "alphas": [0.0]}}
    assert node_quant_type(report, "a") == "none"
    with pytest.raises(ValueError, match="quant type must be one of"):
        node_quant_type({"nodes": ["a"], "plan": {"assignment": [4], "alphas": [0.0], "quant_types": ["fp3"]}}, "a")


# ------------------------------------------------------------------------------ exactness


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-12)


def _with_choices(count: int) -> list[int]:
    """The first `count` seeds from 900 on whose random problem gives a node more than one precision to choose from."""
    seeds = (seed for seed in itertools.count(900) if max(map(len, _small(seed).quant_choices)) > 1)
    return list(itertools.islice(seeds, count))


def _small(seed: int) -> PlanInputs:
    return random_inputs(seed, 2 + seed % 2, 3 + seed % 3)


@pytest.mark.parametrize("seed", _with_choices(8))
def test_choosing_per_stage_is_the_best_over_every_combination_of_precisions(seed):
    """The DP's per-stage choice against brute force over every assignment and every fixed precision per node."""
    inputs = _small(seed)
    choices = inputs.quant_choices
    try:
        got = plan(inputs).throughput
    except PlanInfeasibleError:
        got = None
    best = None
    for combo in itertools.product(*choices):
        nodes = [node.model_copy(update={"quant_type": quant}) for node, quant in zip(inputs.nodes, combo)]
        try:
            result = brute_force(inputs.model_copy(update={"nodes": nodes})).throughput
        except PlanInfeasibleError:
            continue
        best = result if best is None else max(best, result)
    assert (got is None) == (best is None)
    assert got is None or _close(got, best)


def test_random_problems_exercise_precisions():
    """The problems the DP is checked on against brute force choose quantised and mixed precisions."""
    seen = set()
    for seed in range(3):
        for num_nodes in range(1, 5):
            for num_blocks in range(1, 11):
                inputs = random_inputs(seed * 1000 + num_nodes * 100 + num_blocks, num_nodes, num_blocks)
                try:
                    chosen = {q for q in plan(inputs).quant_types if q is not None}
                except PlanInfeasibleError:
                    continue
                seen |= chosen
                if len(chosen) > 1:
                    seen.add("mixed")
                if any(node.quant_type for node in inputs.nodes):
                    seen.add("fixed")
    assert seen == {"none", "int8", "nf4", "mixed", "fixed"}


# ------------------------------------------------------------------------------------------ CLI


def test_cli_compares_precisions(tmp_path, capsys):
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(_problem(2, 10)))
    assert main(["--nodes", str(path)]) == 1
    capsys.readouterr()
    assert main(["--nodes", str(path), "--quant", "none,nf4"]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "nf4 2.73 GiB" in out  # the stage table's weights column
    assert "no quant_costs.nf4 measured" in out
    comparison = out.split("precision comparison")[1].split("\n\n")[0].splitlines()
    assert comparison[1].split()[:2] == ["none", "infeasible:"]
    assert comparison[2].split()[0] == "nf4" and "1 node(s), 2 hops" in comparison[2]
    assert comparison[3].split()[0] == "none,nf4" and "n0 2.73 GiB nf4" in comparison[3]
    assert main(["--nodes", str(path), "--quant", "nf4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["quant_types"] == ["nf4", None] and "precision_comparison" not in report


def test_cli_rejects_an_unknown_precision(tmp_path, capsys):
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(_problem(2, 10)))
    with pytest.raises(SystemExit) as exit_:
        main(["--nodes", str(path), "--quant", "fp3"])
    assert exit_.value.code == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert "--quant" in first and "none, int8, nf4" in first and "'fp3'" in first


def test_measure_asks_for_every_allowed_precision(monkeypatch, capsys):
    """--measure passes the allowed precisions to the server's profile and prints the node's quant_costs."""
    from bloombee.server import profile

    calls = []
    cost = {"table": {"micro_batch": [1], "mlp_ms": [1.0], "attn_gpu_ms": [0.1], "attn_cpu_ms": [0.5]}}

    def measure_node(model, name, **kwargs):
        calls.append(kwargs)
        quant_costs = {quant: cost for quant in kwargs["quant_types"] if quant != "none"}
        return {**_node(name), "gpu": "cpu", "cost": cost, "quant_costs": quant_costs}

    monkeypatch.setattr(profile, "measure_node", measure_node)
    assert main(["--measure", "--model", "bloombee-tiny", "--quant", "none,int8,nf4", "--name", "here"]) == 0
    assert tuple(calls[0]["quant_types"]) == ("none", "int8", "nf4")
    [node] = yaml.safe_load(capsys.readouterr().out)["nodes"]
    assert set(node["quant_costs"]) == {"int8", "nf4"}
    assert main(["--measure", "--model", "bloombee-tiny", "--name", "here"]) == 0
    assert tuple(calls[1]["quant_types"]) == ("none",)
