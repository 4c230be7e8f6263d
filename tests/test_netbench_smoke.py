"""End to end: the harness builds namespaces, shapes links, runs a real 2-server swarm, and removes everything.

Needs root with `ip` and `tc` (the suite's own `unshare --net` namespace is enough); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.netbench import netns
from benchmarks.netbench.models import RandomLlama, make_random_llama


def _why_not() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root for network namespaces"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)}"
    probe = f"{netns.PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], check=False, capture_output=True)
    return None


REASON = _why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """hidden 512 fp32 at batch 16: 32 KB per hop and step, 13 ms at 20 Mbit/s; 2 small blocks."""
    folder = tmp_path_factory.mktemp("netbench") / "smoke-llama"
    return make_random_llama(RandomLlama(hidden=512, layers=2, intermediate=1024, heads=8, kv_heads=8, vocab=256), folder)


def sweep_command(model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.netbench", "sweep", "--model", str(model), "--servers", "2", "--batch", "16",
            "--prompt-len", "4", "--new-tokens", "8", "--warmup-steps", "1", "--envs", "E1,E5", "--configs", "baseline",
            "--background-s", "1", "--no-plots", "--startup-timeout", "150", "--out", str(out)]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def links_here() -> list[str]:
    """Interfaces of the namespace the test runs in (the harness must never add one here)."""
    out = subprocess.run(["ip", "-o", "link", "show"], check=True, capture_output=True, text=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


def assert_nothing_left(owner: int, model: Path, links_before: list[str]) -> None:
    assert netns.harness_namespaces(owner) == [], "namespaces left behind"
    assert links_here() == links_before, "interfaces added to the test's own namespace"
    deadline = time.monotonic() + 10
    while processes_mentioning(str(model)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(model)) == [], "processes left behind"


@pytest.mark.timeout(300)
def test_two_server_sweep_over_two_environments(model, tmp_path):
    out = tmp_path / "out"
    began, links_before = time.monotonic(), links_here()
    proc = subprocess.Popen(sweep_command(model, out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"the sweep took over 240 s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    data = json.loads((out / "summary.json").read_text())
    runs = {run["env"]: run for run in data["runs"]}
    assert set(runs) == {"E1", "E5"}
    e1, e5 = runs["E1"], runs["E5"]
    # 3 hops x 32 KB at 20 Mbit/s add ~40 ms to every step
    assert e5["step_median_s"] > e1["step_median_s"] + 0.02, (e1["step_median_s"], e5["step_median_s"])
    assert e5["decode_tokens_per_s"] < e1["decode_tokens_per_s"]
    for run in (e1, e5):
        assert run["servers"] == 2 and run["decode_steps"] == 7
        assert all(16 * 512 * 4 <= size < 16 * 512 * 4 + 1024 for size in run["hop_wire_bytes"])  # raw fp32 + frame header
        # the interfaces saw what the processes say they sent (a looser band than the report's: few steps here)
        assert all(0.9 <= ratio <= 1.3 for ratio in run["iface_over_app"]), run["iface_over_app"]
        assert run["floor_s"] > 0 and run["measured_over_floor"] >= 0.9
    assert e5["floor_s"] > e1["floor_s"]
    assert data["meta"]["leftover_namespaces"] == []
    assert (out / "summary.md").exists() and len(list((out / "runs").glob("*.json"))) == 2
    assert_nothing_left(proc.pid, model, links_before)
    print(f"smoke sweep took {time.monotonic() - began:.0f} s")


@pytest.mark.timeout(180)
def test_interrupted_sweep_leaves_nothing(model, tmp_path):
    links_before = links_here()
    proc = subprocess.Popen(sweep_command(model, tmp_path / "out"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,  # SIGINT as Ctrl-C finds it, also in a background suite
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    server_ns = f"{netns.PREFIX}{proc.pid}-s1"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:  # wait until a server process runs in its namespace
        if server_ns in netns.list_namespaces() and netns.namespace_pids(server_ns):
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "interrupted" in output
    assert_nothing_left(proc.pid, model, links_before)


@pytest.mark.timeout(300)
def test_speculative_configuration_runs_through_generate(tmp_path):
    """bloombee-tiny names its draft: `speculative` speculates (token trees through the chain), `baseline` runs the
    step loop, both with tokens/s in one summary."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks.netbench", "sweep", "--model", "bloombee-tiny", "--servers", "2",
               "--batch", "1", "--prompt-len", "8", "--new-tokens", "12", "--warmup-steps", "1", "--envs", "E1",
               "--configs", "baseline,speculative", "--warmup-round-tokens", "0", "--background-s", "1", "--no-plots",
               "--startup-timeout", "150", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    runs = {run["config"]: run for run in json.loads((out / "summary.json").read_text())["runs"]}
    assert runs["baseline"].get("mode") is None and runs["baseline"]["decode_steps"] == 11
    speculative = runs["speculative"]
    assert speculative["mode"] == "generate" and speculative["tree_rounds"] > 0
    assert speculative["decode_tokens_per_s"] > 0 and speculative["decode_steps"] < 11
    assert "## Speculative decoding" in (out / "summary.md").read_text()
