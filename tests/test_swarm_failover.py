"""Servers die mid-generation (SIGKILL): the session re-routes, replays history, and the tokens do not change."""

import signal
import time

import pytest
import torch
from transformers import StoppingCriteriaList

from bloombee.dht.records import ServerState, fetch_records
from swarm_support import KillServerAt, client, reference, save_tiny_llama, serving

PROMPT = torch.tensor([[11, 22, 33, 44, 55]])
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model") / "failover-llama")
    with serving(folder, tmp_path_factory, {"a1": "0:4", "a2": "0:4", "b1": "4:8", "b2": "4:8"},
                 "--dtype", "float32") as swarm:
        yield swarm


@pytest.fixture(scope="module")
def expected(swarm):
    return reference(swarm.model).generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.mark.parametrize("span_index", [1, 0], ids=["second-server-dies", "first-server-dies"])
def test_generation_survives_sigkill(swarm, expected, span_index):
    model = client(swarm, request_timeout=30.0)
    killer = KillServerAt(swarm, model, span_index, after=8, prompt_length=PROMPT.shape[1])
    with model.inference_session(max_length=64) as session:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, stopping_criteria=StoppingCriteriaList([killer]))
        assert killer.killed is not None and session.recoveries >= 1
        assert killer.killed not in {span.record.public_name for span in session.spans}
    assert torch.equal(out, expected)


def test_clean_shutdown_announces_offline(swarm):
    survivor = next(name for name in ("b1", "b2") if swarm.server(name).process.poll() is None)
    swarm.kill(survivor, signal.SIGTERM)
    assert swarm.server(survivor).process.returncode == 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = {record.state for records in fetch_records(swarm.dht, swarm.prefix, swarm.num_blocks)
                  for record in records.values() if record.public_name == survivor}
        if states == {ServerState.OFFLINE}:
            return
        time.sleep(0.5)
    raise AssertionError(f"{survivor} still announces {states} after a clean shutdown")
