"""Compression forced on for every hop (client -> server, server -> server push, server -> client):
greedy generation through the swarm still equals the local transformers model token for token."""

import pytest
import torch

from bloombee import codec
from swarm_support import client, reference, save_tiny_llama, start_swarm

SERVER_ARGS = ["--dtype", "float32", "--max-length", "96", "--max-batch-size", "4", "--compression", "on"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model") / "codec-llama")
    swarm = start_swarm(folder, tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"))
    try:
        for name, blocks in (("first", "0:4"), ("second", "4:8")):
            swarm.add_server("--blocks", blocks, *SERVER_ARGS, name=name, wait=False)
        swarm.wait_online(["first", "second"])
        yield swarm
    finally:
        swarm.stop()


def test_every_hop_compressed_and_generation_exact(swarm):
    model = client(swarm, compression="on", micro_batches=1)  # whole steps: each hop's tensor is worth compressing
    ref = reference(swarm.model)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35], [2, 71, 82, 81, 82, 84]])
    assert torch.equal(
        model.generate(ids, max_new_tokens=24, do_sample=False),
        ref.generate(ids, max_new_tokens=24, do_sample=False),
    )

    hidden = model.head.embed(ids)
    with model.remote.inference_session(max_length=16, batch_size=2) as session:
        for step in (hidden, hidden[:, -1:]):  # a prompt step, then a decode step
            out = session.step(step)
            stats = session.last_step
            compressed = codec.auto_candidates(torch.float32, tuple(step.shape))
            assert stats.client_layout in compressed and stats.sent_wire_bytes < stats.sent_raw_bytes
            assert [report.layout in compressed for report in stats.reports] == [True, True]
            assert all(report.wire_bytes < report.raw_bytes for report in stats.reports)
            assert out.shape == step.shape


def test_receivers_decode_speeds_reach_the_senders_policies(swarm):
    model = client(swarm, compression="on")
    hidden = model.head.embed(torch.tensor([[5, 6, 7, 8]]))
    with model.remote.inference_session(max_length=16, batch_size=1) as session:
        session.step(hidden)
        for _ in range(2):  # the second decode step carries the speeds the first one measured
            session.step(hidden[:, -1:])
        first, second = session.spans
    # the client's policy for each server holds that server's own decode speed, from its hop report
    for span in (first, second):
        assert model.remote.policy_for(span.peer_id, span.record).measured_decompress_speed(hidden[:, -1:].nbytes) > 0
    # the first server's push policy for the second adopted the second's speed, which the step's route carried
    links = model.remote.server_info(first.peer_id)["links"]
    push = links[second.peer_id]["estimates"]["< 512 B"]  # a decode step's 256 B
    assert push["observations"]["decode"] >= 1 and push["decompress_speed"] > 0
    # and the last server's reply policy adopted the client's own decode speed, carried by the step header
    reply = model.remote.server_info(second.peer_id)["links"][model.remote.p2p.peer_id.to_base58()]["estimates"]["< 512 B"]
    assert reply["observations"]["decode"] >= 1



def test_a_client_that_turns_compression_off_gets_raw_hops_from_servers_that_compress(swarm):
    model = client(swarm, compression="off", micro_batches=1)  # the servers run --compression on
    hidden = model.head.embed(torch.tensor([[3, 14, 15, 92, 65, 35], [2, 71, 82, 81, 82, 84]]))
    with model.remote.inference_session(max_length=16, batch_size=2) as session:
        for step in (hidden, hidden[:, -1:]):
            session.step(step)
            stats = session.last_step
            assert stats.client_layout == "raw"
            assert [report.layout for report in stats.reports] == ["raw", "raw"]  # the push and the reply
    forced = client(swarm, compression="on", micro_batches=1)
    with forced.remote.inference_session(max_length=16, batch_size=2) as session:
        session.step(hidden)
        assert all(report.layout != "raw" for report in session.last_step.reports)  # the same servers, sessions apart
