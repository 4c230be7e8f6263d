"""A server's memory budget in bytes, live: accounting equals the sessions' tensors, a session over budget waits in
line and is refused with the budget named while the others go on, and an offloaded server gives the reference tokens."""

import threading
import time

import pytest
import torch

from bloombee.client import RequestRejected
from swarm_support import NUM_BLOCKS, client, poll, reference, save_tiny_llama, start_swarm, weight_bytes

BATCH, LENGTH = 2, 64
KV_DEVICE_PER_TOKEN = NUM_BLOCKS * 2 * 1 * 16 * 4  # blocks x (K, V) x 1 of 2 KV heads on the device x head_dim x fp32
HOST_PER_TOKEN = KV_DEVICE_PER_TOKEN + 64 * 4 + 1  # the other KV head, the output history (hidden 64) and the mask
ALLOC_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model") / "memory-llama")
    weights = weight_bytes(folder, 0, NUM_BLOCKS)
    room = BATCH * LENGTH * KV_DEVICE_PER_TOKEN * 3 // 2  # one session of BATCH x LENGTH fits, two do not
    swarm = start_swarm(folder, tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"))
    try:
        swarm.add_server("--blocks", f"0:{NUM_BLOCKS}", "--dtype", "float32", "--offload", "0.5",
                         "--device-memory", str(weights + room), "--host-memory", "64MiB",
                         "--alloc-timeout", str(ALLOC_TIMEOUT), name="tight")
        yield swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def model(swarm):
    with client(swarm) as model:
        yield model


def used(model, peer_id: str) -> tuple[int, int]:
    info = model.remote.server_info(peer_id)
    return info["device_memory_bytes"] - info["device_free_bytes"], info["host_memory_bytes"] - info["host_free_bytes"]


def test_the_budget_holds_what_a_session_allocates_and_gets_it_back(model):
    with model.remote.inference_session(max_length=LENGTH, batch_size=BATCH) as session:
        session.step(model.head.embed(torch.tensor([[4, 5, 6]] * BATCH)))
        peer = session.spans[0].peer_id
        assert used(model, peer) == (BATCH * LENGTH * KV_DEVICE_PER_TOKEN, BATCH * LENGTH * HOST_PER_TOKEN)
    poll(lambda: used(model, peer) == (0, 0), 5, "the session's memory given back")  # the server ends it after the stream


def test_a_session_over_budget_waits_then_is_refused_naming_the_budget_while_the_first_goes_on(model):
    outcome = {}

    def open_second():
        began = time.monotonic()
        try:
            with model.remote.inference_session(max_length=LENGTH, batch_size=BATCH):
                outcome["opened"] = True
        except RequestRejected as error:
            outcome["error"], outcome["waited"] = str(error), time.monotonic() - began

    with model.remote.inference_session(max_length=LENGTH, batch_size=BATCH) as first:
        peer = first.spans[0].peer_id
        second = threading.Thread(target=open_second)
        second.start()
        for token in range(8):  # the open session keeps stepping while the other waits in line
            first.step(model.head.embed(torch.tensor([[token + 1]] * BATCH)))
        second.join(timeout=30)
        assert "opened" not in outcome
        assert ALLOC_TIMEOUT - 0.5 <= outcome["waited"] <= ALLOC_TIMEOUT + 5
        assert "--device-memory" in outcome["error"] and "--alloc-timeout" in outcome["error"]
        assert first.position == 8
    poll(lambda: used(model, peer) == (0, 0), 5, "the session's memory given back")  # the server ends it after the stream


def test_a_waiting_session_opens_as_soon_as_room_is_given_back(model):
    outcome = {}

    def open_second():
        began = time.monotonic()
        with model.remote.inference_session(max_length=LENGTH, batch_size=BATCH) as second:
            outcome["waited"], outcome["peer"] = time.monotonic() - began, second.spans[0].peer_id
            second.step(model.head.embed(torch.tensor([[1, 2]] * BATCH)))

    with model.remote.inference_session(max_length=LENGTH, batch_size=BATCH) as first:
        first.step(model.head.embed(torch.tensor([[3]] * BATCH)))
        thread = threading.Thread(target=open_second)
        thread.start()
        time.sleep(0.5)
    thread.join(timeout=30)
    assert 0.3 <= outcome["waited"] < ALLOC_TIMEOUT
    # the client does not wait for the server to end a closed session's stream: its bytes come back just after
    poll(lambda: used(model, outcome["peer"]) == (0, 0), 10, "the closed sessions' bytes given back")


def test_a_session_larger_than_the_whole_budget_is_refused_at_once(model):
    began = time.monotonic()
    with pytest.raises(RequestRejected, match=r"budget is .* in all"):
        model.remote.inference_session(max_length=LENGTH, batch_size=4 * BATCH)
    assert time.monotonic() - began < ALLOC_TIMEOUT


def test_the_offloaded_server_gives_the_reference_tokens(swarm, model):
    prompt = torch.tensor([[5, 9, 2, 7, 1, 3], [8, 8, 4, 6, 2, 9]])
    expected = reference(swarm.model).generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=24, do_sample=False), expected)
