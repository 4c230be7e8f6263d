"""The README's main command: a real local swarm on bloombee-tiny, one streamed generation, clean shutdown."""

import os
import re
import subprocess
import sys
from pathlib import Path


def test_demo_runs_a_local_swarm_and_shuts_it_down(tmp_path):
    result = subprocess.run([str(Path(sys.executable).parent / "bloombee-client"), "demo", "--max-new-tokens", "12"],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "BLOOMBEE_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Starting server0 with blocks 0:4 of 8" in result.stdout and "Starting server1 with blocks 4:8 of 8" in result.stdout
    assert "def fibonacci(n):" in result.stdout and "Shutting the swarm down." in result.stdout
    # bloombee-tiny names its draft, so the default (draft_model auto, speculation auto) speculates
    summary = re.search(r"\[(\d+) tokens in [\d.]+ s, [\d.]+ tokens/s, servers: server0\[0:4\] -> server1\[4:8\], "
                        r"speculative decoding: ([\d.]+) tokens per step on average \((\d+) steps through the servers\)\]",
                        result.stderr)
    assert summary and float(summary[2]) == round(int(summary[1]) / int(summary[3]), 1)
    assert "draft-tree" not in result.stderr and "rounds" not in result.stderr
    log_dir = re.search(r"logs in (\S+)\)", result.stdout).group(1)
    for log in Path(log_dir).glob("server*.log"):
        assert "Announced offline and stopped" in log.read_text()
