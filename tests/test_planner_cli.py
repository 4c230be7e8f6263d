"""`bloombee-plan` end to end: table, --json, --plot, --model from a local folder, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from bloombee.cli.plan import main

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
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_table_with_workload_flags():
    result = _run(
        "--nodes", str(EXAMPLES / "e6.yaml"), "--batch-sizes", "16", "32", "--micro-batches", "1", "4", "--seq-len", "512"
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("a100-california", "rtx4090-canada", "estimated throughput", "even split", "greedy", "bottleneck", "compression"):
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
