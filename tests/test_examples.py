"""The worked examples in examples/ run (briefly) as a user would run them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_prompt_tuning_example_trains_through_a_local_swarm(tmp_path):
    plot = tmp_path / "loss.png"
    out = subprocess.run([sys.executable, "examples/prompt_tuning.py", "--steps", "3", "--plot", str(plot)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    assert plot.stat().st_size > 0
    assert "loss " in out.stdout and "after tuning:" in out.stdout
