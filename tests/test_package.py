import subprocess
import sys
from pathlib import Path

import pytest

import bloombee

SCRIPTS = ["bloombee-server", "bloombee-dht", "bloombee-client", "bloombee-plan", "bloombee-codegen", "bloombee-api"]


def test_version_is_a_string():
    assert isinstance(bloombee.__version__, str) and bloombee.__version__.count(".") == 2


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_is_installed_and_answers_help(script):
    result = subprocess.run([str(Path(sys.executable).parent / script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"usage: {script}" in result.stdout


def test_top_level_import_is_light_and_names_the_model_classes():
    code = ("import sys, bloombee; assert 'torch' not in sys.modules; "
            "from bloombee import AutoDistributedModel, AutoDistributedModelForCausalLM; "
            "from bloombee.client import DistributedModelForCausalLM; "
            "assert AutoDistributedModel is AutoDistributedModelForCausalLM is DistributedModelForCausalLM")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
