"""The remaining faults, with real processes: bloombee-tiny (bfloat16), 240 greedy tokens, the fault at token 80.

A server frozen (SIGSTOP) then thawed (SIGCONT), a server SIGKILLed and restarted with the same identity, the bootstrap
peer going away and, as root, a server's network link going down: each generation completes with exactly the tokens of
an undisturbed run, its stalled step is bounded, and afterwards the client's view recovers: once its ban (1 s here)
expires, the server is routed to again. The swarm: "whole" serves blocks 0:8 (one hop, the cheapest chain, so every
session goes through it) and "front" 0:4 plus "back" 4:8 take over while it is down. The link test (root and `ip`
only) runs its own swarm, with "whole" in a network namespace of its own behind a veth pair; so does the slow-link test,
whose pushes take longer than the push timeout and must not count as failures."""

import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from bloombee.client import AutoDistributedModel
from bloombee.dht.records import ServerRecord, ServerState, fetch_records
from bloombee.loading import dht_prefix, resolve_model
from bloombee.local_swarm import LocalSwarm
from bloombee.settings import ClientSettings
from swarm_support import poll

pytestmark = pytest.mark.timeout(180)

MODEL = "bloombee-tiny"
NEW_TOKENS, DISRUPT_AT, CHECK_TOKENS = 240, 80, 24
BAN_SECONDS = 1.0
HOP_PENALTY = 0.2  # seconds per hop: every session takes the one-hop chain through "whole" whatever servers measure
STALL_LIMIT = 3 * ClientSettings().step_timeout_min  # detection (a step deadline at most), then a replay of ~85 steps
RECOVERY_LIMIT = 90.0  # seconds from the fault's end until the server is usable in the client's view again
WATCH_PERIOD = 0.2  # seconds between checks whether it is
SERVERS = {"whole": "0:8", "front": "0:4", "back": "4:8"}
NODE_NS, HOST_LINK = f"bbfault{os.getpid()}", f"bbf{os.getpid()}h"  # the link test's namespace and this side's veth
HOST_IP, NODE_IP = f"10.78.{os.getpid() % 256}.1", f"10.78.{os.getpid() % 256}.2"


def start_swarm(tmp_path_factory, bootstrap_args=(), placement=lambda name: ((), ())) -> LocalSwarm:
    """A bootstrap peer and the three SERVERS, each with the (extra arguments, command prefix) `placement` gives it;
    "whole" keeps its identity in the log folder."""
    logs = tmp_path_factory.mktemp("logs")
    cache = str(tmp_path_factory.mktemp("cache"))
    swarm = LocalSwarm(MODEL, 8, dht_prefix(MODEL), log_dir=str(logs), env={"BLOOMBEE_CACHE": cache})
    try:
        swarm.start_bootstrap(*bootstrap_args)
        for name, blocks in SERVERS.items():
            identity = ["--identity-path", str(logs / f"{name}.key")] if name == "whole" else []
            args, prefix = placement(name)
            swarm.add_server("--blocks", blocks, "--max-length", "512", *identity, *args, name=name, wait=False,
                             prefix=prefix)
        swarm.wait_online(list(SERVERS))
    except BaseException:
        swarm.stop()
        raise
    return swarm


@pytest.fixture(scope="module")
def prompt():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    return tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids


def open_model(initial_peers: list[str]):
    return AutoDistributedModel.from_pretrained(MODEL, initial_peers=initial_peers, ban_base_seconds=BAN_SECONDS,
                                                hop_penalty_seconds=HOP_PENALTY)


def generate(model, prompt, new_tokens: int = NEW_TOKENS, fault=None):
    """Greedy tokens in one session (EOS suppressed); the session, for its recoveries and spans."""
    criteria = StoppingCriteriaList([fault] if fault else [])
    with model.inference_session(max_length=prompt.shape[1] + new_tokens) as session:
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             stopping_criteria=criteria)
    return out, session


def undisturbed_run(swarm: LocalSwarm, prompt) -> torch.Tensor:
    """The reference tokens, through "whole" alone."""
    with open_model(swarm.initial_peers) as model:
        out, session = generate(model, prompt)
    assert session.recoveries == 0 and out.shape[1] == prompt.shape[1] + NEW_TOKENS
    assert [span.record.public_name for span in session.spans] == ["whole"]
    return out


class Fault(StoppingCriteria):
    """At DISRUPT_AT generated tokens, `begin(name)` on the server of the session's first span; at the next token, once
    the client got past the fault, `end(name)` (if given); from then on, notes when `back()` first holds; times every
    step."""

    def __init__(self, model, prompt_length: int, begin, end=None, back=None):
        self.model, self.prompt_length, self.begin, self.end, self.back = model, prompt_length, begin, end, back
        self.victim: str | None = None
        self.times: list[float] = []
        self.at = -1
        self.begun_at: float | None = None
        self.ended_at: float | None = None
        self.back_at: float | None = None
        self._checked_at = float("-inf")

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.monotonic())
        if self.victim is None and input_ids.shape[1] - self.prompt_length >= DISRUPT_AT:
            self.victim = self.model._session.spans[0].record.public_name
            self.begin(self.victim)
            self.at, self.begun_at = len(self.times) - 1, time.monotonic()
        elif self.at >= 0 and self.ended_at is None:
            if self.end is not None:
                self.end(self.victim)
            self.ended_at = time.monotonic()
        elif self.ended_at is not None:
            self.watch()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def watch(self) -> None:
        """Check `back()`, at most every WATCH_PERIOD seconds, until it holds."""
        if self.back is None or self.back_at is not None or time.monotonic() - self._checked_at < WATCH_PERIOD:
            return
        self._checked_at = time.monotonic()
        if self.back():
            self.back_at = time.monotonic()

    def wait_back(self) -> float:
        """The moment `back()` first held, polling past the end of the generation if need be."""
        return self.back_at or poll(self.back, RECOVERY_LIMIT, "the server usable again")

    @property
    def stalled_step(self) -> float:
        """Seconds from the fault until the next token."""
        return self.times[self.at + 1] - self.begun_at


def records_of(swarm: LocalSwarm, name: str) -> dict[str, ServerRecord]:
    """The records of server `name` by peer id, as the DHT shows them now."""
    return {peer_id: record for records in fetch_records(swarm.dht, swarm.prefix, swarm.num_blocks)
            for peer_id, record in records.items() if record.public_name == name}


def usable(model, peer_id: str):
    """A check whether `peer_id` is usable in the client's view (its ban over, its record online), read afresh."""
    manager = model.remote.manager

    def check() -> bool:
        manager.update(force=True)
        return peer_id in manager.usable_servers()

    return check


def assert_routed_through(model, peer_id: str, prompt, reference: torch.Tensor) -> None:
    """A new session of the client goes through `peer_id` alone and gives the reference tokens."""
    out, session = generate(model, prompt, CHECK_TOKENS)
    assert [span.peer_id for span in session.spans] == [peer_id] and session.recoveries == 0
    assert torch.equal(out, reference[:, :out.shape[1]])


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = start_swarm(tmp_path_factory)
    try:
        yield swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def undisturbed(swarm, prompt):
    return undisturbed_run(swarm, prompt)


def test_a_frozen_then_thawed_server_costs_a_bounded_step_and_is_used_again(swarm, prompt, undisturbed):
    (peer_id,) = records_of(swarm, "whole")
    with open_model(swarm.initial_peers) as model:
        fault = Fault(model, prompt.shape[1], lambda name: swarm.signal_all(name, signal.SIGSTOP),
                      lambda name: swarm.signal_all(name, signal.SIGCONT), usable(model, peer_id))
        try:
            out, session = generate(model, prompt, fault=fault)
        finally:
            swarm.signal_all("whole", signal.SIGCONT)
        recovered = fault.wait_back() - fault.ended_at
        assert_routed_through(model, peer_id, prompt, undisturbed)
    report = (f"SIGSTOP..SIGCONT of whole: stalled step {fault.stalled_step:.2f} s, usable again {recovered:.1f} s "
              "after SIGCONT")
    print(report)
    assert fault.victim == "whole" and session.recoveries >= 1, report
    assert torch.equal(out, undisturbed), report
    assert ClientSettings().step_timeout_min <= fault.stalled_step < STALL_LIMIT, report


def test_a_server_restarted_with_its_identity_is_routed_to_again(swarm, prompt, undisturbed):
    ((peer_id, before),) = records_of(swarm, "whole").items()
    killed_at = []

    def kill_and_restart(name):
        swarm.kill(name)  # SIGKILL to it, its DHT child and its p2p daemon
        killed_at.append(time.monotonic())
        swarm.restart(name)

    def restarted() -> bool:
        record = records_of(swarm, "whole").get(peer_id)
        return record is not None and record.state == ServerState.ONLINE and record.maddrs != before.maddrs

    with open_model(swarm.initial_peers) as model:
        is_usable = usable(model, peer_id)
        fault = Fault(model, prompt.shape[1], kill_and_restart, back=lambda: restarted() and is_usable())
        out, session = generate(model, prompt, fault=fault)
        recovered = fault.wait_back() - killed_at[0]
        assert_routed_through(model, peer_id, prompt, undisturbed)
    report = (f"SIGKILL + restart of whole: stalled step {fault.stalled_step:.2f} s, online at a new address and "
              f"usable again {recovered:.1f} s after the kill")
    print(report)
    assert set(records_of(swarm, "whole")) == {peer_id}, report
    assert fault.victim == "whole" and session.recoveries >= 1, report
    assert torch.equal(out, undisturbed), report
    assert fault.stalled_step < STALL_LIMIT, report


def test_clients_join_through_a_server_once_the_bootstrap_peer_is_gone(swarm, prompt, undisturbed):
    def kill_bootstrap(name):
        os.killpg(swarm.bootstrap.pid, signal.SIGKILL)
        swarm.bootstrap.wait(timeout=10)

    with open_model(swarm.initial_peers) as model:
        fault = Fault(model, prompt.shape[1], kill_bootstrap)
        out, session = generate(model, prompt, fault=fault)
        model.remote.manager.update(force=True)
        still_seen = {record.public_name for record in model.remote.manager.usable_servers().values()}
    (front,) = records_of(swarm, "front").values()
    server_peers = list(front.maddrs)
    began = time.monotonic()
    with open_model(server_peers) as newcomer:
        joined = time.monotonic() - began
        late_out, late_session = generate(newcomer, prompt)
    report = (f"bootstrap SIGKILLed: the running client's step then {fault.stalled_step:.3f} s; a new client joined "
              f"through front in {joined:.1f} s")
    print(report)
    assert swarm.bootstrap.poll() is not None and not set(server_peers) & set(swarm.initial_peers), report
    assert session.recoveries == 0 and torch.equal(out, undisturbed), report
    assert still_seen == set(SERVERS), report
    assert late_session.recoveries == 0 and torch.equal(late_out, undisturbed), report


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def leftovers() -> list[str]:
    """The link test's namespace and veth, where they still exist."""
    found = [NODE_NS] if NODE_NS in ip("netns", "list").stdout.split() else []
    return found + ([HOST_LINK] if ip("link", "show", HOST_LINK, check=False).returncode == 0 else [])


@pytest.fixture(scope="module")
def island():
    """A network namespace for one server, linked to this one by a veth pair (HOST_IP here, NODE_IP there); both gone
    afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and `ip` (iproute2) for a network namespace")
    made = ip("netns", "add", NODE_NS, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        ip("link", "add", HOST_LINK, "type", "veth", "peer", "name", "eth0", "netns", NODE_NS)
        ip("addr", "add", f"{HOST_IP}/24", "dev", HOST_LINK)
        ip("link", "set", HOST_LINK, "up")
        ip("-n", NODE_NS, "link", "set", "lo", "up")
        ip("-n", NODE_NS, "addr", "add", f"{NODE_IP}/24", "dev", "eth0")
        ip("-n", NODE_NS, "link", "set", "eth0", "up")
        yield NODE_NS
    finally:
        ip("link", "delete", HOST_LINK, check=False)
        ip("netns", "delete", NODE_NS, check=False)
        poll(lambda: not leftovers(), 10, "the namespace and veth removed")


@pytest.fixture(scope="module")
def island_swarm(island, tmp_path_factory):
    """The swarm with "whole" in the island namespace: every peer listens on its veth address, not on loopback."""
    here = ("--host-maddrs", f"/ip4/{HOST_IP}/tcp/0", "--no-nat-traversal")
    there = (("--host-maddrs", f"/ip4/{NODE_IP}/tcp/0", "--no-nat-traversal"), ("ip", "netns", "exec", island))
    swarm = start_swarm(tmp_path_factory, here, lambda name: there if name == "whole" else (here, ()))
    try:
        yield swarm
    finally:
        swarm.stop()


def test_a_server_whose_link_goes_down_for_seconds_costs_a_bounded_step_and_is_used_again(island, island_swarm, prompt):
    reference = undisturbed_run(island_swarm, prompt)
    ((peer_id, record),) = records_of(island_swarm, "whole").items()
    assert record.maddrs and all(f"/ip4/{NODE_IP}/" in maddr for maddr in record.maddrs), record.maddrs

    def link(state: str) -> None:
        ip("-n", island, "link", "set", "eth0", state)

    with open_model(island_swarm.initial_peers) as model:
        fault = Fault(model, prompt.shape[1], lambda name: link("down"), lambda name: link("up"),
                      usable(model, peer_id))
        try:
            out, session = generate(model, prompt, fault=fault)
        finally:
            link("up")
        recovered = fault.wait_back() - fault.ended_at
        assert_routed_through(model, peer_id, prompt, reference)
    report = (f"link of whole down for {fault.ended_at - fault.begun_at:.2f} s: stalled step "
              f"{fault.stalled_step:.2f} s, usable again {recovered:.1f} s after the link came up")
    print(report)
    assert fault.victim == "whole" and session.recoveries >= 1, report
    assert torch.equal(out, reference), report
    assert ClientSettings().step_timeout_min <= fault.stalled_step < STALL_LIMIT, report


SLOW_MBPS = 2.0  # the island server's shaped uplink, Mbit/s
PUSH_TIMEOUT = 1.0  # seconds, far less than its prompt's push takes at SLOW_MBPS


def test_a_push_slower_than_the_push_timeout_over_a_slow_link_is_not_a_failure(island, tmp_path_factory):
    """"a" (blocks 0:4, in the island behind a 2 Mbit/s tbf uplink that it announces) pushes a 4 x 200-token float32
    prompt (0.8 MB, ~3.5 s) to "b" (4:8) with --push-timeout 1: the acknowledgement is due a second after the bytes
    can have arrived, not a second after they left, so nothing fails and nobody is banned."""
    ip("netns", "exec", island, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{SLOW_MBPS:g}mbit",
       "burst", "32kbit", "latency", "2s")
    here = ("--host-maddrs", f"/ip4/{HOST_IP}/tcp/0", "--no-nat-traversal")
    there = ("--host-maddrs", f"/ip4/{NODE_IP}/tcp/0", "--no-nat-traversal")
    logs = tmp_path_factory.mktemp("slow-logs")
    swarm = LocalSwarm(MODEL, 8, dht_prefix(MODEL), log_dir=str(logs),
                       env={"BLOOMBEE_CACHE": str(tmp_path_factory.mktemp("slow-cache"))})
    try:
        swarm.start_bootstrap(*here)
        common = ("--dtype", "float32", "--max-length", "256", "--push-timeout", f"{PUSH_TIMEOUT:g}")
        swarm.add_server("--blocks", "0:4", *common, *there, "--link-bandwidth-mbps", f"{SLOW_MBPS:g}", name="a",
                         prefix=("ip", "netns", "exec", island))
        swarm.add_server("--blocks", "4:8", *common, *here, name="b")
        prompt = torch.randint(5, 4000, (4, 200), generator=torch.Generator().manual_seed(3))
        with AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers, dtype=torch.float32,
                                                  compression="off") as model:
            with model.inference_session(max_length=208, batch_size=4) as session:
                began = time.monotonic()
                out = model.generate(prompt, max_new_tokens=4, do_sample=False)
                took = time.monotonic() - began
            banned = model.remote.manager.banned_servers()
        reference = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float32).generate(
            prompt, max_new_tokens=4, do_sample=False)
    finally:
        swarm.stop()
        ip("netns", "exec", island, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
    prompt_push = prompt.numel() * 256 * 4 * 8 / (SLOW_MBPS * 1e6)
    assert took > prompt_push > 3 * PUSH_TIMEOUT, (took, prompt_push)
    assert session.recoveries == 0 and not banned, (session.recoveries, banned)
    assert torch.equal(out, reference)
