"""`bloombee-plan` end to end: table, --json, --plot, --model from a local folder, exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bloombee.cli.plan import main
from bloombee.planner.report import plot_title, size_text

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "plans"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, "-m", "bloombee.cli.plan", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_cli_json_and_plot(tmp_path):
    png = tmp_path / "plan.png"
    result = _run("--nodes", str(EXAMPLES / "e5.yaml"), "--json", "--plot", str(png))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["feasible"] is True
    chosen = report["plan"]
    assert sum(chosen["assignment"]) == 60 and chosen["throughput_tokens_per_s"] > 0
    assert chosen["batch_size"] in report["workload"]["batch_sizes"]
    assert chosen["micro_batches"] in report["workload"]["micro_batches"]
    stages = chosen["evaluation"]["stages"]
    assert [s["node"] for s in stages] == report["nodes"]
    assert all(0.0 <= s["alpha"] <= 1.0 for s in stages)
    assert {"even", "greedy"} == set(report["baselines"])
    assert report["baselines"]["even"]["throughput_tokens_per_s"] <= chosen["throughput_tokens_per_s"]
    assert report["compressed_hops"] and report["simulated_step_s"] > 0
    assert report["throughput_tokens_per_s"] == pytest.approx(chosen["batch_size"] / report["simulated_step_s"])
    assert report["closed_form_step_s"] == pytest.approx(chosen["evaluation"]["step_time_s"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_table_with_workload_flags():
    result = _run(
        "--nodes", str(EXAMPLES / "e6.yaml"), "--batch-sizes", "16", "32", "--micro-batches", "1", "4", "--seq-len", "512"
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("a100-california", "rtx4090-canada", "throughput:", "even split", "greedy", "bottleneck", "compression"):
        assert text in out
    assert "context 512" in out
    # the candidate grid has exactly the flags' values
    grid = out.split("tokens/s per candidate")[1]
    assert "M=1" in grid and "M=4" in grid and "M=2" not in grid


def test_cli_model_from_local_folder(tmp_path):
    from transformers import LlamaConfig

    folder = tmp_path / "tiny-llama"
    LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, vocab_size=1000
    ).save_pretrained(folder)
    raw = yaml.safe_load((EXAMPLES / "e3.yaml").read_text())
    nodes_only = {"client": raw["client"], "nodes": raw["nodes"]}
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(nodes_only))
    result = _run("--model", str(folder), "--nodes", str(path), "--json", "--batch-sizes", "8")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    model = report["model"]
    assert model["num_blocks"] == 6 and model["hidden_size"] == 256
    # q, k, v, o with 2 KV heads of 32 + gated MLP + 2 norms, fp16
    params = 256 * 256 + 2 * 256 * 64 + 256 * 256 + 3 * 256 * 512 + 2 * 256
    assert model["weight_bytes_per_block"] == 2 * params
    assert model["kv_bytes_per_token_per_block"] == 2 * 2 * 32 * 2
    assert sum(report["plan"]["assignment"]) == 6


def test_cli_exit_codes(tmp_path, capsys):
    raw = yaml.safe_load((EXAMPLES / "e1.yaml").read_text())
    for node in raw["nodes"]:
        node["gpu_memory_gib"] = 2.0
    infeasible = tmp_path / "small.yaml"
    infeasible.write_text(yaml.safe_dump(raw))
    assert main(["--nodes", str(infeasible)]) == 1
    err = capsys.readouterr().err
    assert "no feasible plan" in err and "GPU memory" in err

    raw["nodes"][0]["gpu_memory_gib"] = "big"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    assert main(["--nodes", str(bad)]) == 2
    assert "nodes[0].gpu_memory_gib" in capsys.readouterr().err

    no_model = tmp_path / "nomodel.yaml"
    no_model.write_text(yaml.safe_dump({"client": raw["client"], "nodes": raw["nodes"][1:]}))
    assert main(["--nodes", str(no_model)]) == 2
    assert "--model" in capsys.readouterr().err

    assert main(["--nodes", str(no_model), "--model", str(tmp_path / "nowhere")]) == 2
    assert "cannot load the config" in capsys.readouterr().err


def test_cli_function_prints_json(capsys):
    assert main(["--nodes", str(EXAMPLES / "e2.yaml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["throughput_tokens_per_s"] > 0


def test_one_headline_figure_from_the_simulated_step(tmp_path):
    """The text's throughput is B over the simulated step, the plot's title says the same, and the DP's closed form is
    shown only as a step time."""
    path = str(EXAMPLES / "e5.yaml")
    report = json.loads(_run("--nodes", path, "--json").stdout)
    png = tmp_path / "e5.png"
    out = _run("--nodes", path, "--plot", str(png)).stdout
    batch, simulated_ms = report["plan"]["batch_size"], report["simulated_step_s"] * 1e3
    headline = re.search(r"^throughput: ([\d.]+) tokens/s \(B=(\d+) tokens per simulated step of ([\d.]+) ms\)", out, re.MULTILINE)
    assert headline and float(headline[1]) == pytest.approx(batch / simulated_ms * 1e3, abs=0.05)
    assert float(headline[3]) == pytest.approx(simulated_ms, abs=0.05)
    closed = re.search(r"^closed-form estimate the DP optimised: ([\d.]+) ms/step", out, re.MULTILINE)
    assert closed and float(closed[1]) == pytest.approx(report["closed_form_step_s"] * 1e3, abs=0.05)
    assert "estimated throughput" not in out and out.count("tokens/s (B=") == 1
    assert plot_title(_evaluation(report), report["simulated_step_s"]).startswith(
        f"B={batch}, M={report['plan']['micro_batches']} (micro-batch {report['plan']['micro_batch_size']}), {headline[1]} tokens/s")


def _evaluation(report: dict):
    from bloombee.planner.evaluate import Evaluation

    raw = report["plan"]["evaluation"]
    return Evaluation(feasible=True, reason="", assignment=raw["assignment"], batch_size=raw["batch_size"],
                      micro_batches=raw["micro_batches"], micro_batch_size=raw["micro_batch_size"],
                      bottleneck=raw["bottleneck"])


def test_small_model_sizes_and_device_names_are_shown_whole(tmp_path, capsys):
    """A tiny model's per-block sizes read in a unit that shows them, and a CPU node's device name is not cut."""
    raw = yaml.safe_load((EXAMPLES / "e3.yaml").read_text())
    raw["model"] = {"name": "tiny", "num_blocks": 8, "hidden_size": 64, "num_key_value_heads": 2, "head_dim": 8,
                    "intermediate_size": 128, "params_per_block": 40_000}
    raw["workload"]["dtype"] = "bfloat16"
    for node in raw["nodes"]:
        node["gpu"] = "cpu (bfloat16)"
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["--nodes", str(path)]) == 0
    out = capsys.readouterr().out
    assert "78.1 KiB of weights and 64 B of KV per token per block (bfloat16)" in out
    assert "0.00 GiB" not in out and "GPU mem" not in out and "device mem" in out
    assert out.count("cpu (bfloat16)") == len(raw["nodes"])
    assert size_text(1.07e9) == "1020 MiB" and size_text(3 * 2**30) == "3.00 GiB" and size_text(512) == "512 B"


def test_measure_prints_a_node_to_paste_into_nodes_yaml(tmp_path, capsys):
    """--measure times one block of the tiny model here; two copies of its node make a nodes.yaml that plans."""
    from bloombee.planner import NodeSpec

    result = _run("--measure", "--model", "bloombee-tiny", "--measure-sizes", "1", "2", "--seq-len", "8", "--name", "here")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# here timed on one block of bloombee-tiny") and "&id" not in result.stdout
    [node] = yaml.safe_load(result.stdout)["nodes"]
    spec = NodeSpec.model_validate(node)
    assert spec.name == "here" and spec.cost.table.micro_batch == [1, 2] and spec.cost.reference_seq_len == 8
    assert all(ms > 0 for ms in spec.cost.table.mlp_ms) and spec.gpu.startswith("cpu (") and spec.link.uplink_mbps == 100
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"client": {"link": {"uplink_mbps": 100, "downlink_mbps": 100, "latency_ms": 10}},
                                     "nodes": [{**node, "name": "a"}, {**node, "name": "b"}]}))
    assert main(["--nodes", str(nodes), "--model", "bloombee-tiny", "--batch-sizes", "1", "2"]) == 0
    assert "throughput:" in capsys.readouterr().out
    assert main(["--measure"]) == 2
    assert "--measure needs --model" in capsys.readouterr().err
    assert main(["--measure", "--model", "bloombee-tin"]) == 2
    assert "did you mean bloombee-tiny?" in capsys.readouterr().err
