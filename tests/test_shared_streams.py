"""Shared streams: a client's sessions on a server travel as lanes of one stream, what is ready at once bundled."""

import asyncio

import pytest
import torch
from hivemind.proto import runtime_pb2
from pydantic import ValidationError
from swarm_support import Stream, client, generate_at_once, poll, reference, save_tiny_llama, serving

from bloombee.client import RequestRejected
from bloombee.client.loop import run_sync
from bloombee.client.shared_streams import _OPEN
from bloombee.protocol import ErrorKind, ErrorMessage, InvalidStep
from bloombee.protocol.bundles import BUNDLE, MAX_MEMBERS, bundle, bundles, unbundle
from bloombee.protocol.service import block_service_stub

PROMPTS = [torch.tensor([[3, 14, 15, 92, 65]]), torch.tensor([[27, 18, 28]]), torch.tensor([[1, 41, 42, 13, 56, 23, 9]]),
           torch.tensor([[100, 7]])]
NEW_TOKENS = 12
HIDDEN = 64  # the tiny llama's hidden size


def message(uid: str, metadata: bytes = b"{}") -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(uid=uid, metadata=metadata)


def test_a_bundle_carries_its_members_in_order():
    members = [("a", message("step", b'{"x": 1}')), ("b", None), ("a", message("history"))]
    assert unbundle(bundle(members)) == members


@pytest.mark.parametrize("envelope, error, match", [
    (message("step"), InvalidStep, "carries bundles, not 'step'"),
    (message(BUNDLE, b'{"lanes": ["a", "b"]}'), InvalidStep, "names 2 lanes for 0 members"),
    (message(BUNDLE, b'{"lanes": [""]}'), ValidationError, "at least 1 character"),
    (message(BUNDLE, b'{"lanes": "a"}'), ValidationError, "tuple"),
    (message(BUNDLE, b"[1"), ValidationError, "json"),
])
def test_a_malformed_bundle_is_refused_by_name(envelope, error, match):
    with pytest.raises(error, match=match):
        unbundle(envelope)


def test_a_member_that_is_not_an_envelope_is_refused_by_lane():
    garbage = bundle([("lane-7", message("step"))])
    garbage.tensors[0].buffer = b"\xff\xff\xff"
    with pytest.raises(InvalidStep, match="the member of lane 'lane-7' is not an envelope"):
        unbundle(garbage)


def test_what_is_queued_in_one_turn_of_the_loop_goes_as_one_bundle():
    async def collected() -> list[list]:
        outbox = asyncio.Queue()
        for index in range(3):
            outbox.put_nowait((f"lane-{index}", message("step")))
        sent = []
        async for envelope in bundles(outbox):
            sent.append([lane for lane, _ in unbundle(envelope)])
            if len(sent) == 1:
                outbox.put_nowait(("lane-0", None))
                outbox.put_nowait(None)
        return sent

    assert asyncio.run(collected()) == [["lane-0", "lane-1", "lane-2"], ["lane-0"]]


def test_a_bundle_holds_at_most_max_members():
    async def sizes() -> list[int]:
        outbox = asyncio.Queue()
        for _ in range(MAX_MEMBERS + 3):
            outbox.put_nowait(("a", message("step")))
        outbox.put_nowait(None)
        return [len(envelope.tensors) async for envelope in bundles(outbox)]

    assert asyncio.run(sizes()) == [MAX_MEMBERS, 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("model") / "shared-llama")


@pytest.fixture(scope="module")
def swarm(folder, tmp_path_factory):
    with serving(folder, tmp_path_factory, {"a": "0:4", "b": "4:8"}, "--dtype", "float32", "--no-profile",
                 "--max-batch-size", "2") as swarm:
        yield swarm


@pytest.fixture(scope="module")
def model(swarm):
    return client(swarm, request_timeout=30.0)


@pytest.fixture(scope="module")
def expected(folder):
    local = reference(folder)
    return [local.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False) for prompt in PROMPTS]


def open_streams(model) -> dict:
    """Peer id -> the client's shared stream open to it."""
    return dict(_OPEN.get(model.remote.p2p, {}))


def test_sessions_in_threads_share_a_stream_per_server_and_match_the_local_model(model, expected):
    outputs, errors = generate_at_once(model, PROMPTS, NEW_TOKENS)
    assert errors == []
    for output, want in zip(outputs, expected):
        assert torch.equal(output, want)
    assert open_streams(model) == {}  # the last session's lane ended each shared stream


def test_open_sessions_are_lanes_of_one_stream_per_server(model):
    sessions = [model.remote.inference_session(max_length=16) for _ in range(3)]
    try:
        streams = open_streams(model)
        assert len(streams) == 2 and all(set(streams) == {stream.span.peer_id for stream in session.streams}
                                         for session in sessions)
        for session in sessions:
            assert [stream._shared for stream in session.streams] == [streams[stream.span.peer_id]
                                                                      for stream in session.streams]
        hidden = torch.randn(1, 3, HIDDEN)
        outputs = [session.step(hidden) for session in sessions]
        assert all(torch.equal(output, outputs[0]) for output in outputs)
    finally:
        for session in sessions:
            session.close()
    assert open_streams(model) == {}


def test_a_refused_lane_leaves_the_other_lanes_working(model):
    with model.remote.inference_session(max_length=16) as kept:
        before = kept.step(torch.ones(1, 2, HIDDEN))
        with pytest.raises(RequestRejected, match="batch size 3 is over this server's limit of 2"):
            model.remote.inference_session(max_length=16, batch_size=3)
        assert torch.isfinite(kept.step(torch.ones(1, 1, HIDDEN))).all()
        assert len(open_streams(model)) == 2
    assert before.shape == (1, 2, HIDDEN)
    assert open_streams(model) == {}


def test_a_client_may_keep_a_stream_per_session(swarm, expected):
    separate = client(swarm, request_timeout=30.0, shared_streams="off")
    with separate.inference_session(max_length=32):
        assert separate.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, do_sample=False).equal(expected[0])
        assert open_streams(separate) == {}


def test_a_malformed_bundle_ends_its_stream_with_a_clear_error_and_the_server_serves_on(model, expected):
    with model.remote.inference_session(max_length=8) as session:
        stub = block_service_stub(model.remote.p2p, session.streams[0].span.peer_id)

    async def replies():
        """The first reply, then the rest once this side has ended the stream (ending both sides at once can lose
        the server's last reply)."""
        stream = await Stream(stub.rpc_sessions).start(message("step"))
        first = (await stream.reply())[0]
        stream.send(None)
        return first, [reply async for reply in stream.replies]

    error, rest = run_sync(replies(), timeout=30)
    assert rest == []
    assert isinstance(error, ErrorMessage)
    assert error.error_kind == ErrorKind.INVALID
    assert "malformed bundle on a shared stream: a shared stream carries bundles, not 'step'" in error.error
    assert model.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS, do_sample=False).equal(expected[1])


@pytest.mark.parametrize("shared", ["on", "off"])
def test_closing_a_client_ends_the_streams_of_its_open_sessions(swarm, shared):
    closing = client(swarm, request_timeout=30.0, shared_streams=shared)
    session = closing.remote.inference_session(max_length=16)
    session.step(torch.ones(1, 2, HIDDEN))
    shared_streams = list(open_streams(closing).values())
    assert len(shared_streams) == (2 if shared == "on" else 0)
    readers = [stream._reader for stream in session.streams + shared_streams]
    assert not any(reader.done() for reader in readers)
    closing.close()
    poll(lambda: all(reader.done() for reader in readers), 10, "the streams' readers ending")
    assert all(stream._lanes == {} for stream in shared_streams)  # the open session's lanes were given the error
    with pytest.raises(ConnectionError, match="this client's DHT peer has stopped"):
        session.step(torch.ones(1, 1, HIDDEN))
    session.close()
