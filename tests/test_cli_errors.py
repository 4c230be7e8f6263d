"""Mistakes a new user makes with the console scripts: one or two lines naming what was wrong and the fix, a non-zero
exit, a traceback only with --log-level debug; Ctrl-C exits 130; every --help answers without torch."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from api_support import MODEL, start_tiny_swarm
from swarm_support import save_tiny_llama

BIN = Path(sys.executable).parent
SCRIPTS = ["bloombee-server", "bloombee-dht", "bloombee-client", "bloombee-plan", "bloombee-codegen", "bloombee-api"]
FAKE_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"  # nothing listens on port 9
SERVER_MAX_LENGTH = 64


def run(script: str, *args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / script), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def default_sigint() -> None:
    """In the child: SIGINT as a terminal's Ctrl-C finds it (a suite started in the background ignores SIGINT, and
    its children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_short_error(result: subprocess.CompletedProcess, *needles: str, status: int = 1) -> str:
    """Exit status `status`, no traceback, at most two lines on stderr (argparse's usage line counts), each needle in it."""
    assert result.returncode == status, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = start_tiny_swarm(tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"), {"s0": "0:8"},
                             "--max-length", str(SERVER_MAX_LENGTH))
    yield swarm
    swarm.stop()


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_imports_neither_torch_nor_transformers(script):
    result = run(script, *(["generate"] if script == "bloombee-client" else []), "--help")
    assert result.returncode == 0 and "--log-level" in result.stdout and "default" in result.stdout
    code = "import sys, runpy; sys.argv = ['x', '--help']; runpy.run_module('bloombee.cli.{}', run_name='__main__')"
    module = script.removeprefix("bloombee-")
    imports = subprocess.run([sys.executable, "-c", code.format(module)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}, timeout=60)
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in imports.stderr.splitlines() if "|" in line}
    assert imports.returncode == 0 and "bloombee" in imported
    assert not imported & {"torch", "transformers", "hivemind"}, script


def test_help_names_units_of_the_options_that_had_none():
    generate = run("bloombee-client", "generate", "--help").stdout
    for phrase in ("tokens to generate (default: 32)", "(default: 1.0 = all)", "compress activations",
                   "longest ban of a failing server, seconds"):
        assert phrase in " ".join(generate.split()), phrase
    assert "server processes, each with a part of the blocks (default: 2)" in " ".join(run("bloombee-client", "demo", "--help").stdout.split())


def test_unknown_model_suggests_the_closest_alias():
    result = run("bloombee-client", "generate", "--model", "bloombee-tin", "--prompt", "x", "--initial-peers", FAKE_PEER)
    assert_short_error(result, "did you mean bloombee-tiny?")


def test_traceback_only_with_debug_logging():
    result = run("bloombee-client", "generate", "--model", "bloombee-tin", "--prompt", "x", "--initial-peers", FAKE_PEER,
                 "--log-level", "debug")
    assert result.returncode == 1 and "Traceback" in result.stderr and "did you mean bloombee-tiny?" in result.stderr


def test_malformed_initial_peer_says_what_a_valid_one_looks_like():
    result = run("bloombee-client", "generate", "--model", MODEL, "--prompt", "x", "--initial-peers", "127.0.0.1:31337")
    assert_short_error(result, "'127.0.0.1:31337'", "/ip4/", "/p2p/", "bloombee-dht prints it")


def test_unreachable_initial_peer_is_one_line():
    """The p2p daemon gives up on the address (or, on a slow machine, the connect timeout ends first)."""
    result = run("bloombee-client", "generate", "--model", MODEL, "--prompt", "x", "--initial-peers", FAKE_PEER,
                 "--connect-timeout", "60")
    assert_short_error(result, "--initial-peers")


def test_reversed_block_range():
    assert_short_error(run("bloombee-server", "--model", MODEL, "--blocks", "6:2", "--new-swarm"),
                       "--blocks", "START must be at least 0 and below END", "e.g. 2:6", status=2)


def test_num_blocks_above_the_models_blocks():
    assert_short_error(run("bloombee-server", "--model", MODEL, "--num-blocks", "20", "--new-swarm"),
                       "--num-blocks 20 is more than the 8 blocks")


def test_blocks_past_the_last_block():
    assert_short_error(run("bloombee-server", "--model", MODEL, "--blocks", "4:12", "--new-swarm"), "END is at most 8")


def test_plan_node_without_blocks_or_unknown_is_refused_before_joining(tmp_path):
    """--initial-peers names a peer nobody runs: the plan's problem is reported before any attempt to join."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"feasible": True, "nodes": ["a", "b"],
                                "plan": {"assignment": [8, 0], "alphas": [0.0, 0.0], "batch_size": 4, "micro_batches": 1}}))
    common = ("bloombee-server", "--model", MODEL, "--plan", str(plan), "--initial-peers", FAKE_PEER)
    assert_short_error(run(*common, "--node", "b"), f"--plan {plan}: the plan gives node 'b' no blocks",
                       "do not start it, or plan again")
    assert_short_error(run(*common, "--node", "z"), "node 'z' is not in the plan; its nodes are ['a', 'b']",
                       "pass one of them as --node")
    assert_short_error(run(*common), "--plan needs --node NAME")
    plan.write_text("not json")
    assert_short_error(run(*common, "--node", "a"), f"--plan {plan} is not JSON")
    assert_short_error(run("bloombee-server", "--model", MODEL, "--plan", str(tmp_path / "none.json"), "--node", "a",
                           "--initial-peers", FAKE_PEER), "none.json: cannot read it (No such file or directory)")


def test_memory_sizes_and_budgets_that_cannot_hold_the_weights():
    assert_short_error(run("bloombee-server", "--model", MODEL, "--new-swarm", "--device-memory", "lots"),
                       "invalid device_memory", "'lots' is not a memory size; write e.g. 24GiB")
    assert_short_error(run("bloombee-server", "--model", MODEL, "--new-swarm", "--offload", "2"),
                       "offload must be auto or a fraction from 0 to 1")
    assert_short_error(run("bloombee-server", "--model", MODEL, "--new-swarm", "--device-memory", "1MiB",
                           "--blocks", "0:8", "--num-threads", "1", "--log-level", "warning"),
                       "take 10.57 MiB of weights, more than --device-memory 1.00 MiB leaves room for")
    assert_short_error(run("bloombee-server", "--model", MODEL, "--new-swarm", "--device-memory", "1MiB",
                           "--num-threads", "1", "--log-level", "warning"),
                       "one block with the KV cache of --cache-tokens 16384 takes 5.32 MiB in none weights, more than "
                       "the 1.00 MiB of --device-memory")


def test_quant_types_the_server_cannot_load_are_refused_before_joining(tmp_path):
    common = ("bloombee-server", "--model", MODEL, "--initial-peers", FAKE_PEER)
    assert_short_error(run(*common, "--quant-type", "fp3"), "invalid quant_type",
                       "quant type must be one of none, int8, nf4, got 'fp3'")
    assert_short_error(run(*common, "--quant-type", "nf4", "--device", "mps"),
                       "nf4 weights run on cpu or cuda (bitsandbytes), not on mps; use --quant-type none")
    folder = save_tiny_llama(tmp_path / "gptq", num_layers=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    assert_short_error(run("bloombee-server", "--model", str(folder), "--initial-peers", FAKE_PEER),
                       "quantised as gptq, which bloombee cannot load", "bitsandbytes int8 or nf4 checkpoints")
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (folder / "config.json").write_text(json.dumps(config))
    assert_short_error(run("bloombee-server", "--model", str(folder), "--quant-type", "int8", "--initial-peers",
                           FAKE_PEER), "this checkpoint holds nf4 weights; serve it with --quant-type nf4 (or auto)")


def test_demo_with_zero_servers():
    assert_short_error(run("bloombee-client", "demo", "--servers", "0"), "--servers", "must be at least 1", status=2)


@pytest.mark.parametrize("tokens", ["0", "-3"])
def test_max_new_tokens_must_be_positive_before_joining(tokens):
    result = run("bloombee-client", "generate", "--model", MODEL, "--prompt", "x", "--initial-peers", FAKE_PEER,
                 "--max-new-tokens", tokens)
    assert_short_error(result, "--max-new-tokens", "must be at least 1", status=2)


def test_beyond_the_context_length_is_refused_before_joining():
    result = run("bloombee-client", "generate", "--model", MODEL, "--prompt", "x", "--initial-peers", FAKE_PEER,
                 "--max-new-tokens", "2000")
    assert_short_error(result, "beyond bloombee-tiny's context length of 1024")


def test_config_file_and_environment_fill_options(tmp_path):
    config = tmp_path / "client.yaml"
    config.write_text(f"model: bloombee-tiny\ninitial_peers: [{FAKE_PEER}]\nmax_new_tokens: 2000\n")
    assert_short_error(run("bloombee-client", "generate", "--config", str(config), "--prompt", "x"), "context length of 1024")
    result = run("bloombee-client", "generate", "--config", str(config), "--prompt", "x", env={"BLOOMBEE_MAX_NEW_TOKENS": "0"})
    assert_short_error(result, "BLOOMBEE_MAX_NEW_TOKENS", "must be at least 1", status=2)
    config.write_text("modle: bloombee-tiny\n")
    assert_short_error(run("bloombee-client", "generate", "--config", str(config), "--prompt", "x"), "unknown option 'modle'",
                       status=2)


def test_over_a_servers_max_length_names_the_server(swarm):
    result = run("bloombee-client", "generate", "--model", MODEL, "--prompt", "x", "--initial-peers", *swarm.initial_peers,
                 "--max-new-tokens", "8", "--max-length", "100")
    assert_short_error(result, "server s0 refused the session", f"over this server's limit of {SERVER_MAX_LENGTH}")


def test_blocks_nobody_serves_are_named(swarm, tmp_path):
    folder = save_tiny_llama(tmp_path / "unserved-llama")
    result = run("bloombee-client", "generate", "--model", str(folder), "--input-ids", "1,2,3", "--initial-peers",
                 *swarm.initial_peers)
    assert_short_error(result, "blocks 0..7 of model", "are not served", "bloombee-server --model")


def test_ctrl_c_exits_130_with_one_line(swarm):
    process = subprocess.Popen([str(BIN / "bloombee-client"), "generate", "--model", MODEL, "--prompt", "def f",
                                "--initial-peers", *swarm.initial_peers, "--max-new-tokens", "40"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    assert process.stdout.read(5) == "def f"  # printed once the model is loaded, just before generating
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "bloombee-client: interrupted" and "Traceback" not in stderr


DROPPED_CTRL_C = """
import sys, weakref
from bloombee.cli.common import run_main

class Thing:
    pass

def work():
    thing = Thing()
    def interrupted_here(ref):  # where a Ctrl-C can land: Python reports it as unraisable and goes on
        raise KeyboardInterrupt
    ref = weakref.ref(thing, interrupted_here)
    del thing
    print("ran to the end")

sys.exit(run_main("demo", work, "info"))
"""


def test_a_ctrl_c_that_python_drops_in_a_weakref_callback_still_ends_with_130_and_one_line():
    done = subprocess.run([sys.executable, "-c", DROPPED_CTRL_C], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (130, "ran to the end\n", "demo: interrupted\n")
