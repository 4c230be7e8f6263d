"""No process outlives its owner: a server's DHT child and p2p daemon end with it whatever signal ends it, SIGTERM
to a server's process group ends it within seconds at any moment from start-up on, and a client's models free their
DHT peer and p2p daemon on close(), when dropped, and when they fail to connect."""

import gc
import os
import signal
import subprocess
import time

import pytest
import torch
from hivemind.p2p import P2PDaemonError

from bloombee.cli.common import freeze_startup_heap
from bloombee.client import AutoDistributedModel
from bloombee.dht.lifecycle import children, descendants, is_running
from bloombee.dht.records import ServerState, fetch_records
from bloombee.loading import dht_prefix
from bloombee.local_swarm import LocalSwarm

MODEL = "bloombee-tiny"
ENDS_WITHIN = 5.0  # seconds for a server, its children and a client's DHT peer to be gone


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = LocalSwarm(MODEL, 8, dht_prefix(MODEL), log_dir=str(tmp_path_factory.mktemp("logs")),
                       env={"BLOOMBEE_CACHE": str(tmp_path_factory.mktemp("cache"))})
    swarm.start_bootstrap()
    try:
        swarm.add_server("--blocks", "0:8", name="warm")  # measures the figures the later servers take from the cache
        yield swarm
    finally:
        swarm.stop()


def wait_gone(pids: list[int], within: float = ENDS_WITHIN) -> list[int]:
    """The pids still running after `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(is_running(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if is_running(pid)]


def command(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return "(ended)"


def test_a_server_killed_with_sigkill_leaves_no_child(swarm):
    server = swarm.add_server("--blocks", "0:4", name="killed")
    below = descendants(server.process.pid)
    assert any("p2pd" in command(pid) for pid in below), [command(pid) for pid in below]
    os.kill(server.process.pid, signal.SIGKILL)  # the server process alone, as `kill -9 PID` does
    server.process.wait(timeout=10)
    assert wait_gone(below) == []


def test_sigterm_to_the_process_group_of_a_serving_server_ends_it_offline(swarm):
    server = swarm.add_server("--blocks", "4:8", name="served")
    below = descendants(server.process.pid)
    began = time.monotonic()
    os.killpg(server.process.pid, signal.SIGTERM)
    assert server.process.wait(timeout=ENDS_WITHIN) == 0
    print(f"group SIGTERM: the serving server ended in {time.monotonic() - began:.2f} s")
    assert wait_gone(below) == []
    states = {record.state for records in fetch_records(swarm.dht, swarm.prefix, swarm.num_blocks)
              for record in records.values() if record.public_name == "served"}
    assert states == {ServerState.OFFLINE}


@pytest.mark.parametrize("moment", ["importing", "joined-dht", "blocks-loaded"])
def test_sigterm_to_the_process_group_during_start_up_ends_it(swarm, moment):
    server = swarm.add_server("--blocks", "0:8", name=f"starting-{moment}", wait=False)
    reach(server, moment)
    below = descendants(server.process.pid)
    began = time.monotonic()
    os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=ENDS_WITHIN)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"server still running {ENDS_WITHIN:g} s after SIGTERM while {moment}:\n"
                             f"{server.log_tail()}") from None
    print(f"group SIGTERM while {moment}: ended in {time.monotonic() - began:.2f} s, code {server.process.returncode}")
    assert wait_gone(below) == []


def reach(server, moment: str) -> None:
    """Wait until the starting server is at `moment`: still importing, its DHT peer up, loading its blocks."""
    if moment == "importing":
        time.sleep(0.3)
        return
    marker = {"joined-dht": "DHT peer", "blocks-loaded": "Loaded blocks"}[moment]
    deadline = time.monotonic() + 60
    while marker not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline and server.process.poll() is None, server.log_tail()
        time.sleep(0.02)


def test_sigint_to_a_server_ends_it_cleanly(swarm):
    server = swarm.add_server("--blocks", "0:4", name="interrupted")
    below = descendants(server.process.pid)
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=ENDS_WITHIN) == 0
    assert wait_gone(below) == []


def test_models_opened_and_closed_in_a_loop_leave_no_process(swarm):
    before = set(children(os.getpid()))
    for _ in range(3):
        with AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers) as model:
            assert set(children(os.getpid())) - before  # its DHT peer runs while the model is open
            assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2).shape[1] == 5
    assert wait_gone(list(set(children(os.getpid())) - before)) == []


def test_a_dropped_model_frees_its_dht_peer(swarm):
    before = set(children(os.getpid()))
    model = AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers)
    started = set(children(os.getpid())) - before
    assert started
    del model
    gc.collect()
    assert wait_gone(list(started)) == []


def test_a_model_that_cannot_connect_leaves_no_process(swarm):
    before = set(children(os.getpid()))
    dead_peer = swarm.initial_peers[0].replace(swarm.initial_peers[0].split("/")[4], "1")  # a closed port
    began = time.monotonic()
    with pytest.raises((P2PDaemonError, TimeoutError)):
        AutoDistributedModel.from_pretrained(MODEL, initial_peers=[dead_peer], connect_timeout=3.0)
    assert time.monotonic() - began < 3.0 + ENDS_WITHIN
    assert wait_gone(list(set(children(os.getpid())) - before)) == []


def test_a_frozen_start_up_heap_stays_out_of_full_collections():
    """What a server (or bloombee-api) has loaded when it starts serving is frozen: a full collection then scans only
    the objects made after it."""
    gc.collect()
    loaded = len(gc.get_objects())
    freeze_startup_heap()
    try:
        assert gc.get_freeze_count() >= loaded
        assert len(gc.get_objects()) < loaded // 100
    finally:
        gc.unfreeze()
