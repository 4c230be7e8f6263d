"""The planner in the swarm: servers profile themselves, bloombee-plan plans the live swarm, servers follow a plan."""

import json
import subprocess
import sys

import pytest
import yaml

from bloombee.dht.records import fetch_records
from bloombee.planner import NodeSpec
from bloombee.planner.placement import current_assignment, node_range
from swarm_support import save_tiny_llama, start_swarm, weight_bytes


def test_node_range_reads_a_plan_report():
    report = {"nodes": ["a", "b", "c"], "plan": {"assignment": [5, 0, 3], "alphas": [0.0, 0.0, 0.25]}}
    assert node_range(report, "a") == (0, 5, 0.0)
    assert node_range(report, "c") == (5, 8, 0.25)
    with pytest.raises(ValueError, match="gives node 'b' no blocks"):
        node_range(report, "b")
    with pytest.raises(ValueError, match=r"node 'z' is not in the plan; its nodes are \['a', 'b', 'c'\]"):
        node_range(report, "z")
    with pytest.raises(ValueError, match="no feasible plan: too big"):
        node_range({"feasible": False, "reason": "too big"}, "a")


def test_current_assignment_needs_one_pipeline():
    assert current_assignment([("a", 0, 3), ("b", 3, 8)], 8) == ([3, 5], "")
    assert current_assignment([("a", 0, 4), ("b", 2, 8)], 8)[1].startswith("b serves 2:8, not starting at block 4")
    assert current_assignment([("a", 0, 4)], 8)[1] == "the servers cover blocks 0:4 of 8"


PLAN_BATCH, PLAN_SEQ_LEN = 4, 128
KV_PER_TOKEN_BLOCK = 2 * 2 * 16 * 4  # (K, V) x 2 KV heads x head_dim 16 x float32


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model") / "plan-llama")
    weights = weight_bytes(folder, 0, 4)
    kv = 4 * PLAN_BATCH * PLAN_SEQ_LEN * KV_PER_TOKEN_BLOCK  # 4 blocks' cache for the planned workload
    device_memory = weights + kv // 2 + 16 * 1024  # half the cache on the device: 4 blocks need offload
    cache = tmp_path_factory.mktemp("cache")
    swarm = start_swarm(folder, tmp_path_factory.mktemp("logs"), cache)
    profiles = tmp_path_factory.mktemp("profiles")
    try:
        for name, blocks in (("left", "0:4"), ("right", "4:8")):
            swarm.add_server("--blocks", blocks, "--dtype", "float32", "--profile", str(profiles / f"{name}.yaml"),
                             "--device-memory", str(device_memory), name=name, wait=False)
        swarm.wait_online(["left", "right"])
        swarm.profiles, swarm.cache = profiles, cache
        yield swarm
    finally:
        swarm.stop()


def test_profile_is_a_valid_planner_node(swarm):
    node = yaml.safe_load((swarm.profiles / "left.yaml").read_text())["nodes"][0]
    spec = NodeSpec.model_validate(node)
    assert spec.name == "left" and spec.gpu_memory_gib > 0 and spec.compression.ratio > 0
    assert all(value > 0 for value in spec.cost.table.mlp_ms)


def test_profiles_announce_what_messages_cost_their_host(swarm):
    """Both servers run on this host: they announce the figures it measured, once (cached under its fingerprint)."""
    left, right = (NodeSpec.model_validate(yaml.safe_load((swarm.profiles / f"{name}.yaml").read_text())["nodes"][0]).cpu
                   for name in ("left", "right"))
    assert left.message_ms > 0 and left.stack_mbps > 0 and 0 < left.daemon_share < 1 and 0 < left.interpreter_share <= 1
    assert left == right
    measured = json.loads((swarm.cache / "host_costs.json").read_text())
    assert len(measured) == 1 and next(iter(measured.values()))["message_ms"] == left.message_ms


def test_live_swarm_plan_reads_in_the_servers_terms(swarm):
    """The text report sizes the tiny model in units that show it, takes the servers' announced dtype and prints each
    server's device whole, as device (not GPU) memory."""
    result = subprocess.run([sys.executable, "-m", "bloombee.cli.plan", "--initial-peers", *swarm.initial_peers,
                             "--model", swarm.model, "--batch-sizes", str(PLAN_BATCH)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert "0.00 GiB" not in first and " 0 KiB" not in first
    assert f"{KV_PER_TOKEN_BLOCK} B of KV per token per block (float32)" in first
    assert result.stdout.count("cpu (float32)") == 2 and "device mem" in result.stdout and "GPU" not in result.stdout


def test_plan_for_the_live_swarm_and_follow_it(swarm, tmp_path):
    result = subprocess.run([sys.executable, "-m", "bloombee.cli.plan", "--initial-peers", *swarm.initial_peers,
                             "--model", swarm.model, "--batch-sizes", str(PLAN_BATCH), "--micro-batches", "1",
                             "--seq-len", str(PLAN_SEQ_LEN), "--dtype", "float32", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["nodes"] == ["left", "right"] and sum(report["plan"]["assignment"]) == 8
    assert report["current"]["assignment"] == [4, 4] and report["current"]["throughput_tokens_per_s"] > 0
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(result.stdout)
    busiest = max(range(2), key=lambda index: report["plan"]["assignment"][index])
    start, end, _ = node_range(report, report["nodes"][busiest])
    swarm.add_server("--plan", str(plan_path), "--node", report["nodes"][busiest], "--dtype", "float32", name="planned")
    assert swarm.online_names()["planned"] == (start, end)
    record = next(record for records in fetch_records(swarm.dht, swarm.prefix, swarm.num_blocks)
                  for record in records.values() if record.public_name == "planned")
    assert (record.planned_batch_size, record.planned_micro_batches) == (
        report["plan"]["batch_size"], report["plan"]["micro_batches"])
    assert report["plan"]["alphas"][busiest] > 0 and record.offload == report["plan"]["alphas"][busiest]


def test_servers_without_a_profile_are_left_out_of_the_plan(swarm):
    swarm.add_server("--blocks", "0:8", "--dtype", "float32", "--no-profile", name="plain")
    result = subprocess.run([sys.executable, "-m", "bloombee.cli.plan", "--initial-peers", *swarm.initial_peers,
                             "--model", swarm.model, "--batch-sizes", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "plain" not in result.stdout
