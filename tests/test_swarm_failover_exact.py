"""Failover is invisible: bloombee-tiny in its own dtype (bfloat16), 600 greedy tokens through 3 servers, some with half
their KV cache offloaded to host memory. A server SIGKILLed (first, middle or last) or SIGSTOPped (first or middle) at
token 180 changes no token, and the step it stalls
costs a bounded time that does not depend on the 60 s request timeout: a killed server's connection closes (found
within a second), a frozen middle one leaves the push to it unacknowledged (reported by the server before it after
--push-timeout), a frozen first one misses the client's step deadline (max(step_timeout_min, 3x the expected step time))."""

import os
import signal
import time

import pytest
import torch
from transformers import AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from bloombee.client import AutoDistributedModel
from bloombee.loading import dht_prefix, resolve_model
from bloombee.local_swarm import LocalSwarm
from bloombee.settings import ClientSettings

MODEL = "bloombee-tiny"
SERVERS = {"a1": "0:3", "a2": "0:3", "a3": "0:3", "b1": "3:5", "b2": "3:5", "b3": "3:5", "c1": "5:8", "c2": "5:8"}
OFFLOADED = {"a2", "b2", "c2"}  # half of their KV cache (one of two KV heads) in host memory: a replay onto or from them
PUSH_TIMEOUT = 3.0  # below the client's step deadline (step_timeout_min), so that a frozen middle server is found by the push
NEW_TOKENS, DISRUPT_AT = 600, 180
# the detection bound for these tiny steps is max(step_timeout_min, 3 x expected) = step_timeout_min; a recovery then
# opens a session, fetches the history and replays ~185 steps: the stalled step must stay within 3x that bound
STALL_LIMIT = 3 * ClientSettings().step_timeout_min


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = LocalSwarm(MODEL, 8, dht_prefix(MODEL), log_dir=str(tmp_path_factory.mktemp("logs")),
                       env={"BLOOMBEE_CACHE": str(tmp_path_factory.mktemp("cache"))})
    swarm.start_bootstrap()
    try:
        for name, blocks in SERVERS.items():
            swarm.add_server("--blocks", blocks, "--max-length", "1024", "--push-timeout", str(PUSH_TIMEOUT),
                             "--offload", "0.5" if name in OFFLOADED else "0", name=name, wait=False)
        swarm.wait_online(list(SERVERS))
        yield swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def prompt():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    return tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids


def generate(swarm, prompt, disruption=None):
    """600 greedy tokens in one session (EOS suppressed); the session, for its recoveries and spans."""
    with AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers) as model:
        criteria = StoppingCriteriaList([disruption.bind(model)] if disruption else [])
        with model.inference_session(max_length=prompt.shape[1] + NEW_TOKENS) as session:
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 stopping_criteria=criteria)
        return out, session


@pytest.fixture(scope="module")
def undisturbed(swarm, prompt):
    out, session = generate(swarm, prompt)
    assert session.recoveries == 0 and out.shape[1] == prompt.shape[1] + NEW_TOKENS
    return out


class Disruption(StoppingCriteria):
    """After DISRUPT_AT generated tokens, do `action(swarm, name)` to the server of span `span_index`; time every step."""

    def __init__(self, swarm, prompt_length: int, span_index: int, action):
        self.swarm, self.prompt_length, self.span_index, self.action = swarm, prompt_length, span_index, action
        self.model = None
        self.victim: str | None = None
        self.times: list[float] = []
        self.at = -1

    def bind(self, model):
        self.model = model
        return self

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.monotonic())
        if self.victim is None and input_ids.shape[1] - self.prompt_length >= DISRUPT_AT:
            self.victim = self.model._session.spans[self.span_index].record.public_name
            self.action(self.swarm, self.victim)
            self.at = len(self.times) - 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    @property
    def stalled_step(self) -> float:
        """Seconds of the step that met the disruption (the next token after it)."""
        return self.times[self.at + 1] - self.times[self.at]

    @property
    def usual_step(self) -> float:
        steps = [after - before for before, after in zip(self.times, self.times[1:])]
        return sorted(steps)[len(steps) // 2]


def sigkill_server_only(swarm, name):
    """`kill -9` of the server process alone: its DHT child and p2p daemon must go by themselves."""
    os.kill(swarm.server(name).process.pid, signal.SIGKILL)


def sigstop_server(swarm, name):
    swarm.signal_all(name, signal.SIGSTOP)


@pytest.mark.parametrize("span_index", [0, 1, 2], ids=["first", "middle", "last"])
def test_sigkill_at_token_180_changes_no_token(swarm, prompt, undisturbed, span_index):
    disruption = Disruption(swarm, prompt.shape[1], span_index, sigkill_server_only)
    out, session = generate(swarm, prompt, disruption)
    print(f"SIGKILL {disruption.victim}: stalled step {disruption.stalled_step:.2f} s (usual {disruption.usual_step:.3f} s)")
    assert disruption.victim is not None and session.recoveries >= 1
    assert disruption.victim not in {span.record.public_name for span in session.spans}
    assert torch.equal(out, undisturbed)
    assert disruption.stalled_step < STALL_LIMIT


@pytest.mark.parametrize("span_index", [1, 0], ids=["middle", "first"])
def test_sigstop_costs_a_bounded_step_and_no_token(swarm, prompt, undisturbed, span_index):
    disruption = Disruption(swarm, prompt.shape[1], span_index, sigstop_server)
    try:
        out, session = generate(swarm, prompt, disruption)
    finally:
        if disruption.victim is not None:
            swarm.signal_all(disruption.victim, signal.SIGCONT)
    print(f"SIGSTOP {disruption.victim}: stalled step {disruption.stalled_step:.2f} s (usual {disruption.usual_step:.3f} s)")
    assert session.recoveries >= 1
    assert disruption.victim not in {span.record.public_name for span in session.spans}
    assert torch.equal(out, undisturbed)
    if span_index == 0:  # nobody pushes to the first server: the client's own deadline finds it
        assert ClientSettings().step_timeout_min <= disruption.stalled_step < STALL_LIMIT
        return
    upstream = [name for name in SERVERS if name.startswith("a") and swarm.server(name).process.poll() is None]
    reports = "".join(swarm.server(name).log_path.read_text() for name in upstream)
    assert f"no acknowledgement within {PUSH_TIMEOUT:g} s" in reports
    assert PUSH_TIMEOUT <= disruption.stalled_step < STALL_LIMIT
