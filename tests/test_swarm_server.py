"""Server behaviour in a live swarm: block choice, session timeouts, identities, the client CLI."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from hivemind.utils import get_dht_time

from bloombee.client import AutoDistributedModel, MissingBlocksError
from bloombee.dht.records import block_key
from bloombee.models.core.packing import granule_slots
from bloombee.server.announcing import EXPIRY_PERIODS, REFRESH_PERIODS
from swarm_support import client, poll, reference, save_tiny_llama, start_swarm

SESSION_BYTES = 4 * 2 * 2 * 16 * 4  # per token: 4 blocks x K and V x 2 KV heads x head_dim 16 x float32


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model") / "server-llama")
    swarm = start_swarm(folder, tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"))
    try:
        swarm.add_server("--blocks", "0:4", "--dtype", "float32", "--session-timeout", "3", name="first")
        swarm.add_server("--num-blocks", "4", "--dtype", "float32", "--rebalance-period", "2", "--announce-period", "1", name="second")
        yield swarm
    finally:
        swarm.stop()


def test_server_without_blocks_takes_the_uncovered_range(swarm):
    assert swarm.online_names() == {"first": (0, 4), "second": (4, 8)}


def test_an_idle_server_announces_its_unchanged_record_only_when_its_refresh_is_due(swarm):
    """"second" (--announce-period 1) checks its record every second; serving no one, it announces it again only
    every REFRESH_PERIODS seconds, each announcement living EXPIRY_PERIODS seconds (its expiration tells when it was
    made)."""
    def expiration() -> float:
        (stored,) = swarm.dht.get(block_key(swarm.prefix, 4), latest=True).value.values()  # "second" alone serves 4
        return stored.expiration_time

    seen = [expiration()]
    while len(seen) < 4:
        poll(lambda: expiration() != seen[-1], REFRESH_PERIODS + 3, "a refreshed record")
        seen.append(expiration())
        assert EXPIRY_PERIODS - 1.5 < seen[-1] - get_dht_time() <= EXPIRY_PERIODS
    assert all(later - earlier >= REFRESH_PERIODS for earlier, later in zip(seen[1:], seen[2:])), seen


def test_idle_session_times_out_frees_cache_and_is_rebuilt(swarm):
    model = client(swarm)
    with model.remote.inference_session(max_length=32) as session:
        hidden = model.head.embed(torch.tensor([[4, 5, 6]]))
        first_out = session.step(hidden)
        first_peer = session.spans[0].peer_id
        info = model.remote.server_info(first_peer)
        assert info["device_memory_bytes"] - info["device_free_bytes"] == granule_slots(32) * SESSION_BYTES
        time.sleep(5)
        info = model.remote.server_info(first_peer)
        assert (info["device_free_bytes"], info["host_free_bytes"]) == (info["device_memory_bytes"], info["host_memory_bytes"])
        next_out = session.step(model.head.embed(torch.tensor([[7]])))
        assert session.recoveries == 1
    ref = reference(swarm.model)
    with torch.no_grad():
        logits = ref(torch.tensor([[4, 5, 6, 7]])).logits
    assert torch.allclose(model.head.logits(first_out), logits[:, :3], atol=1e-5)
    assert torch.allclose(model.head.logits(next_out), logits[:, 3:], atol=1e-5)


def cli_generate(swarm, ids: list[int], *flags: str) -> subprocess.CompletedProcess:
    """`bloombee-client generate` of 6 tokens after `ids` in float32 through the swarm, with `flags` besides."""
    return subprocess.run(
        [sys.executable, "-m", "bloombee.cli.client", "generate", "--model", swarm.model, "--input-ids", ",".join(map(str, ids)),
         "--max-new-tokens", "6", "--dtype", "float32", "--initial-peers", *swarm.initial_peers, *flags],
        capture_output=True, text=True, timeout=300)


def test_client_cli_generates_and_summarises(swarm):
    ids = [3, 1, 4, 1, 5]
    result = cli_generate(swarm, ids)
    assert result.returncode == 0, result.stderr
    expected = reference(swarm.model).generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
    assert result.stdout.split() == [str(token) for token in expected.tolist()]
    assert re.search(r"\[6 tokens in [\d.]+ s, [\d.]+ tokens/s, servers: first\[0:4\] -> second\[4:8\]\]", result.stderr)


def test_client_cli_beam_search_prints_transformers_best_beam(swarm):
    ids = [3, 1, 4, 1, 5]
    result = cli_generate(swarm, ids, "--num-beams", "3")
    assert result.returncode == 0, result.stderr
    local = reference(swarm.model)
    expected = local.generate(torch.tensor([ids]), max_new_tokens=6, num_beams=3, do_sample=False)[0]
    greedy = local.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0]
    assert result.stdout.split() == [str(token) for token in expected.tolist()]  # printed once done: prompt and all
    assert not torch.equal(expected, greedy)  # the test would not tell beam search from greedy otherwise


def test_client_cli_info_lists_servers(swarm):
    result = subprocess.run([sys.executable, "-m", "bloombee.cli.client", "info", "--model", swarm.model,
                             "--initial-peers", *swarm.initial_peers], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"first .* blocks 0:4\s+online", result.stdout) and re.search(r"second .* blocks 4:8\s+online", result.stdout)


def test_identity_file_keeps_peer_id(tmp_path):
    identity = tmp_path / "peer.key"
    ids = []
    for _ in range(2):
        process = subprocess.Popen([sys.executable, "-m", "bloombee.cli.dht", "--identity-path", str(identity)],
                                   stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            for line in process.stdout:
                found = re.search(r"/p2p/(\w+)", line)
                if found:
                    ids.append(found.group(1))
                    break
        finally:
            process.terminate()
            assert process.wait(timeout=30) == 0
            assert not group_alive(process.pid), "bloombee-dht left processes behind"
    assert len(ids) == 2 and ids[0] == ids[1]


def test_server_moves_to_blocks_the_swarm_lost(swarm):
    swarm.add_server("--blocks", "4:8", "--dtype", "float32", name="third")
    swarm.kill("first", signal.SIGTERM)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        online = swarm.online_names()
        if online.get("second") == (0, 4):
            assert online.get("third") == (4, 8)
            return
        time.sleep(1)
    raise AssertionError(f"second did not move to the lost blocks 0:4; swarm shows {swarm.online_names()}")


def test_new_swarm_server_prints_initial_peers_and_serves(tmp_path):
    folder = save_tiny_llama(tmp_path / "new-swarm-llama", num_layers=2)
    process = subprocess.Popen([sys.executable, "-m", "bloombee.cli.server", "--model", str(folder), "--new-swarm",
                                "--dtype", "float32"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "BLOOMBEE_CACHE": str(tmp_path / "cache")}, start_new_session=True)
    try:
        peers = []
        for line in process.stdout:
            peers = re.findall(r"/ip4/\S+/p2p/\w+", line)
            if peers:
                break
        model = AutoDistributedModel.from_pretrained(str(folder), initial_peers=peers, dtype=torch.float32)
        deadline = time.monotonic() + 120
        while True:
            try:
                out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
                break
            except MissingBlocksError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert torch.equal(out, reference(folder).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False))
    finally:
        process.terminate()
        process.wait(timeout=60)
        assert not group_alive(process.pid), "bloombee-server left processes behind"


def group_alive(group: int) -> bool:
    """Whether any process of a process group is still alive a few seconds after its leader exited."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.2)
    os.killpg(group, signal.SIGKILL)
    return True
