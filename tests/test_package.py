import os
import shutil
import subprocess
import sys
import zipfile
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


def test_wheel_ships_specs_and_templates_and_codegen_runs_from_it(tmp_path):
    """specs/ and templates/ sit at the repository root; a built wheel carries them as bloombee/models/specs and
    bloombee/models/templates, and `bloombee-codegen --check` run from the unpacked wheel (outside the checkout)
    finds them and agrees with the wheel's generated packages."""
    root = Path(bloombee.__file__).resolve().parents[1]
    source, wheels, installed = tmp_path / "source", tmp_path / "wheels", tmp_path / "installed"
    for name in ("bloombee", "specs", "templates"):  # a copy, so that no stale build/ of the checkout leaks in
        shutil.copytree(root / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(root / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                            "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("bloombee-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    shipped = installed / "bloombee" / "models"
    assert {p.name for p in (shipped / "specs").glob("*.yaml")} == {p.name for p in (root / "specs").glob("*.yaml")}
    assert {p.name for p in (shipped / "templates").iterdir()} == {p.name for p in (root / "templates").iterdir()}
    code = ("import bloombee.models.codegen as c; from bloombee.cli.codegen import main; "
            f"assert c.SPECS_DIR == c.MODELS_DIR / 'specs' and str(c.MODELS_DIR).startswith({str(installed)!r}); "
            "main(['--check'])")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "families up to date" in result.stdout


@pytest.mark.parametrize("chosen, spin", [({}, bloombee.OMP_SPIN_TURNS), ({"GOMP_SPINCOUNT": "123"}, "123"),
                                          ({"OMP_WAIT_POLICY": "ACTIVE"}, "None")])
def test_import_bounds_the_openmp_spin_unless_the_user_chose_one(chosen, spin):
    env = {key: value for key, value in os.environ.items() if key not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import os, bloombee; print(os.environ.get('GOMP_SPINCOUNT'))"
    result = subprocess.run([sys.executable, "-c", code], env={**env, **chosen}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == spin
