"""Verification of untrusted servers on a real swarm: bloombee-tiny in its own dtype (bfloat16), blocks 0:4 on two honest
servers and a faulty one (tests/faulty_server.py: noisy step outputs from position FAULT_FROM on, a boasted throughput
that draws clients to it), blocks 4:8 on two honest servers."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from bloombee.client import AutoDistributedModel
from bloombee.client.verification import TOLERANCE, difference, tolerance
from bloombee.loading import dht_prefix, resolve_model
from bloombee.local_swarm import LocalSwarm, ServerProcess

MODEL = "bloombee-tiny"
HONEST = {"a1": "0:4", "a2": "0:4", "b1": "4:8", "b2": "4:8"}
FAULTY, FAULTY_BLOCKS = "f", "0:4"
NEW_TOKENS = 64
PROMPT = "def fibonacci(n):\n"
FAULT_FROM = 12  # a few decode steps after the prompt: the first-step check passes, later steps are wrong


def add_faulty_server(swarm: LocalSwarm) -> None:
    """Start tests/faulty_server.py as one more server process of `swarm` (stopped with it)."""
    args = ["--model", MODEL, "--initial-peers", *swarm.initial_peers, "--public-name", FAULTY, "--num-threads", "1",
            "--blocks", FAULTY_BLOCKS]
    log_path = swarm.log_dir / f"{FAULTY}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("faulty_server.py")), str(FAULT_FROM),
                                    *args], stdout=log, stderr=subprocess.STDOUT, env=swarm.env, start_new_session=True)
    swarm.servers.append(ServerProcess(FAULTY, process, log_path, args))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = LocalSwarm(MODEL, 8, dht_prefix(MODEL), log_dir=str(tmp_path_factory.mktemp("logs")),
                       env={"BLOOMBEE_CACHE": str(tmp_path_factory.mktemp("cache"))})
    swarm.start_bootstrap()
    try:
        for name, blocks in HONEST.items():
            swarm.add_server("--blocks", blocks, name=name, wait=False)
        add_faulty_server(swarm)
        swarm.wait_online([*HONEST, FAULTY])
        yield swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def prompt():
    ids = AutoTokenizer.from_pretrained(resolve_model(MODEL))(PROMPT, return_tensors="pt").input_ids
    assert ids.shape[1] < FAULT_FROM
    return ids


def generate(swarm, prompt, **settings):
    """64 greedy tokens in one session; the tokens, the session and its first chain's servers (public name: peer id)."""
    with AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers, verify_seed=0, **settings) as model:
        with model.inference_session(max_length=prompt.shape[1] + NEW_TOKENS) as session:
            first_chain = {span.record.public_name: span.peer_id for span in session.spans}
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        return out, session, first_chain


@pytest.fixture(scope="module")
def honest(swarm, prompt):
    out, session, chain = generate(swarm, prompt, blocked_servers=[FAULTY])
    assert FAULTY not in chain and session.verifier.checks == 0
    return out


def test_honest_swarm_with_every_step_verified_bans_nobody(swarm, prompt, honest):
    out, session, _ = generate(swarm, prompt, blocked_servers=[FAULTY], verify_probability=1.0)
    assert session.verifier.untrusted == [] and session.recoveries == 0
    assert session.verifier.checks == 2 * NEW_TOKENS  # both spans at every step: the prompt's and 63 decode steps
    assert torch.equal(out, honest)


def test_without_verification_the_fault_changes_the_output(swarm, prompt, honest):
    out, session, chain = generate(swarm, prompt)
    assert next(iter(chain)) == FAULTY and session.verifier.checks == 0
    assert not torch.equal(out, honest)
    assert torch.equal(out[:, :FAULT_FROM + 1], honest[:, :FAULT_FROM + 1])  # honest until its fault begins


def test_verification_bans_the_faulty_server_and_keeps_the_tokens(swarm, prompt, honest, caplog):
    with caplog.at_level(logging.WARNING, logger="bloombee.client.verification"):
        out, session, chain = generate(swarm, prompt, verify_probability=1.0)
    faulty_peer = chain[FAULTY]
    assert next(iter(chain)) == FAULTY and session.verifier.untrusted == [faulty_peer]
    assert FAULTY not in [span.record.public_name for span in session.spans] and session.recoveries == 1
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any(faulty_peer in message and "disagrees" in message for message in warnings)
    assert torch.equal(out, honest)


def test_only_the_first_step_of_each_server_is_sure_to_be_checked(swarm, prompt, honest):
    out, session, chain = generate(swarm, prompt, verify_probability=1e-9)
    assert next(iter(chain)) == FAULTY and session.verifier.checks == 2 and session.verifier.untrusted == []
    assert not torch.equal(out, honest)  # its fault began after its first step: unseen at this probability


def test_difference_is_relative_and_counts_real_tokens_only():
    recomputed = torch.randn(2, 3, 16)
    claimed = recomputed.clone()
    claimed[1, 2] += 100.0  # a padded position: ignored
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert difference(claimed, recomputed, mask) == 0.0
    claimed[0, 1] *= 1.05  # 5 % off: under |b| + RMS, at most 0.05
    assert 0.0 < difference(claimed, recomputed, mask) <= 0.05
    assert difference(claimed, recomputed, torch.ones(2, 3, dtype=torch.bool)) > 1.0


def test_tolerance_is_that_of_the_coarsest_dtype():
    fp32, bf16 = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.bfloat16)
    assert tolerance(fp32) == TOLERANCE[torch.float32] < TOLERANCE[torch.bfloat16] == tolerance(fp32, bf16)
