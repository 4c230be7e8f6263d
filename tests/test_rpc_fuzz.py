"""Fuzz every RPC of a live server on 127.0.0.1 with seeded malformed requests while valid traffic runs beside them.

Each malformed request must get a typed error to its sender only; every valid request must return exactly what it
returns on a quiet server; afterwards the server must hold no session and all of its cache budget, and its resident
and peak memory must not have grown."""

import asyncio
import functools
import json
import random
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from hivemind.proto import runtime_pb2

from bloombee import codec
from bloombee.client.loop import client_loop, run_sync
from bloombee.codec.frame import LANE_RAW, checksum, pack_header
from bloombee.dht.peers import start_dht
from bloombee.dht.records import fetch_records
from bloombee.protocol import (BackwardMessage, ErrorKind, ForwardMessage, InfoMessage, Message, MessageKind, OpenMessage, OpenSession,
                               StepHeader, StepMessage, envelope, pack, unpack)
from bloombee.protocol.bundles import MAX_MEMBERS, bundle, unbundle
from bloombee.protocol.service import block_service_stub
from swarm_support import NUM_BLOCKS, Stream, client, save_tiny_llama, start_swarm

PER_KIND = 1000  # malformed requests of each RPC kind
VALID_EVERY = 25  # one valid open among this many malformed ones
WINDOW = 50  # malformed requests in flight (with one or two valid ones) before their replies are read
MAX_LENGTH, MAX_BATCH, HIDDEN = 32, 2, 64
# batch-invariant: the client's rounds, batched with the fuzzer's valid steps, must give their outputs bit for bit
SERVER_ARGS = ["--blocks", f"0:{NUM_BLOCKS}", "--dtype", "float32", "--max-length", str(MAX_LENGTH),
               "--max-batch-size", str(MAX_BATCH), "--batch-invariant", "on"]
BAD_PEERS = ("not a peer id!", "", "Qm", "1")  # not base58, or no multihash
TIMEOUT = 30.0  # seconds any one reply may take
SESSION_LENGTH = 16  # of the fuzzed sessions (batch MAX_BATCH)
RSS_GROWTH = 96 << 20  # bytes the server's resident and peak memory may grow by over the whole fuzz


@functools.cache
def bomb() -> bytes:
    """A valid frame of 16 KiB that decodes to 512 MiB (of zeros)."""
    return codec.encode(torch.zeros(1, 1 << 20, 128), "zstd")


def raw(tensor: torch.Tensor) -> bytes:
    return codec.encode(tensor, "raw")


def junk(rng: random.Random, limit: int = 300) -> bytes:
    return rng.randbytes(rng.randrange(limit))


def huge_frame(rng: random.Random) -> bytes:
    """A frame with a valid header and checksum declaring a huge tensor, and no payload."""
    shape = rng.choice([(1 << 40, 1 << 20, HIDDEN), (1, 1 << 62, 1), (2, 1 << 30, HIDDEN), (1 << 62,)])
    header = pack_header("raw", torch.float32, shape, [(LANE_RAW, 0)])
    return bytes(header + checksum(header, []))


def bad_frame(rng: random.Random, tensor: torch.Tensor) -> bytes:
    """Random bytes, a truncated, damaged or padded frame of `tensor`, a huge declaration or a decompression bomb."""
    frame = codec.encode(tensor, rng.choice(("raw", "zstd", "auto")))
    damaged = bytearray(frame)
    damaged[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
    return rng.choice([junk(rng), frame[:rng.randrange(len(frame))], bytes(damaged), frame + b"\0" + junk(rng, 40),
                       huge_frame(rng), bomb()])


def wrong_hidden(rng: random.Random) -> torch.Tensor:
    """Hidden states of a wrong width, rank, dtype or size (empty, over the batch or length limits)."""
    return rng.choice([torch.randn(1, 1, HIDDEN - 1), torch.randn(1, 1, HIDDEN + 1), torch.randn(HIDDEN),
                       torch.randn(1, 1, 1, HIDDEN), torch.zeros(0, 1, HIDDEN), torch.zeros(1, 0, HIDDEN),
                       torch.ones(1, 1, HIDDEN, dtype=torch.int32), torch.ones(1, 1, HIDDEN, dtype=torch.bool),
                       torch.randn(MAX_BATCH + 1, MAX_LENGTH, HIDDEN), torch.randn(1, MAX_LENGTH + 1, HIDDEN)])


def with_frames(metadata: bytes, frames: list[tuple[str, bytes]]):
    """An envelope of exactly these metadata bytes and named frames."""
    request = envelope(InfoMessage())
    request.metadata = metadata
    for name, frame in frames:
        request.tensors.add(buffer=frame, dtype=name)
    return request


def bad_metadata(rng: random.Random, good: dict) -> bytes:
    """Metadata that is not a valid message: random bytes, cut JSON, not an object, a surplus field, an unknown kind."""
    text = json.dumps(good).encode()
    return rng.choice([junk(rng), text[:rng.randrange(len(text))], b"null", b"[1, 2]", b"\xff\xfe{",
                       json.dumps({**good, "surplus": 1}).encode(), json.dumps({**good, "kind": "nonsense"}).encode()])


def bad_tensors(rng: random.Random, hidden: torch.Tensor) -> list[tuple[str, bytes]]:
    """Tensors a request must be refused for: bad frames, wrong hidden states, wrong masks, unknown or repeated names."""
    batch, tokens = hidden.shape[:2]
    return rng.choice([
        [("hidden", bad_frame(rng, hidden))],
        [("hidden", raw(wrong_hidden(rng)))],
        [("hidden", raw(hidden)), ("token_mask", raw(torch.ones(batch, tokens + 1, dtype=torch.bool)))],
        [("hidden", raw(hidden)), ("token_mask", bad_frame(rng, torch.ones(batch, tokens, dtype=torch.bool)))],
        [("hidden", raw(hidden)), ("surplus", raw(hidden))],
        [("hidden", raw(hidden)), ("hidden", raw(hidden))],
        [("token_mask", raw(torch.ones(batch, tokens, dtype=torch.bool)))],
        [],
    ])


def assert_error(message: Message, kind: ErrorKind = ErrorKind.INVALID) -> None:
    assert message.kind == MessageKind.ERROR and message.error, message
    assert message.error_kind == kind, message


class Fuzzer:
    """Seeded malformed requests of every RPC kind, with valid requests among them, from one client identity."""

    def __init__(self, p2p, peer_id: str, seed: int):
        self.stub, self.rng, self.sent = block_service_stub(p2p, peer_id), random.Random(seed), Counter()
        self.step_ids = iter(range(1000, 10 ** 9))

    # -- info ---------------------------------------------------------------------------------

    def bad_info(self):
        good = {"kind": "info"}
        return self.rng.choice([
            with_frames(bad_metadata(self.rng, good), []),
            with_frames(json.dumps({"kind": "forward"}).encode(), []),
            with_frames(json.dumps(good).encode(), [("hidden", codec.encode(torch.zeros(1, 1, HIDDEN)))]),
            with_frames(json.dumps(good).encode(), [("junk", junk(self.rng))]),
        ])

    async def fuzz_info(self, expected_keys: set[str]) -> None:
        valid = pack(InfoMessage())
        for _ in range(PER_KIND // WINDOW):
            window = [self.bad_info() for _ in range(WINDOW)]
            window.insert(self.rng.randrange(WINDOW), valid)
            replies = await asyncio.gather(*(self.stub.rpc_info(request, timeout=TIMEOUT) for request in window))
            for request, reply in zip(window, replies):
                message = unpack(reply)[0]
                if request is valid:
                    assert message.kind == MessageKind.INFO and set(message.info) == expected_keys
                else:
                    assert_error(message)
            self.sent["info"] += WINDOW

    # -- forward ------------------------------------------------------------------------------

    def bad_forward(self, hidden: torch.Tensor):
        good = {"kind": "forward", "start_block": 0, "end_block": NUM_BLOCKS}
        frames = [("hidden", codec.encode(hidden))]
        blocks = self.rng.choice([{"start_block": -1}, {"end_block": NUM_BLOCKS + 1}, {"end_block": 0},
                                  {"start_block": 3, "end_block": 3}, {"start_block": 2 ** 70}, {"end_block": None}])
        return self.rng.choice([
            with_frames(bad_metadata(self.rng, good), frames),
            with_frames(json.dumps({**good, "kind": "step"}).encode(), frames),
            with_frames(json.dumps({k: v for k, v in {**good, **blocks}.items() if v is not None}).encode(), frames),
            with_frames(json.dumps(good).encode(), bad_tensors(self.rng, hidden)),
        ])

    async def fuzz_forward(self, hidden: torch.Tensor, expected: torch.Tensor) -> None:
        stream = await Stream(self.stub.rpc_forward).start()
        valid = pack(ForwardMessage(start_block=0, end_block=NUM_BLOCKS), {"hidden": hidden})
        for _ in range(PER_KIND // WINDOW):
            window = [self.bad_forward(hidden) for _ in range(WINDOW)]
            window.insert(self.rng.randrange(WINDOW), valid)
            await exchange(stream, window, valid, "hidden", expected)
            self.sent["forward"] += WINDOW
        assert await stream.close() == []

    # -- backward -----------------------------------------------------------------------------

    def kept_forward(self, hidden: torch.Tensor, forward_id: str):
        return pack(ForwardMessage(start_block=0, end_block=NUM_BLOCKS, forward_id=forward_id), {"hidden": hidden})

    def bad_backward(self, kept_id: str, other_id: str, hidden: torch.Tensor):
        """A malformed backward; `kept_id` is a forward this client keeps, `other_id` one another client keeps."""
        good = {"kind": "backward", "forward_id": kept_id}
        grad = [("grad_outputs", codec.encode(torch.ones_like(hidden)))]
        wrong_grads = [torch.ones(*hidden.shape[:2], HIDDEN + 1), torch.ones(hidden.shape[0], hidden.shape[1] + 1, HIDDEN),
                       torch.ones(HIDDEN), torch.ones_like(hidden, dtype=torch.long)]
        return self.rng.choice([
            with_frames(bad_metadata(self.rng, good), grad),
            with_frames(json.dumps({**good, "kind": "forward"}).encode(), grad),
            with_frames(json.dumps({**good, "forward_id": self.rng.choice(["no-such-forward", other_id, "", "x" * 129])}).encode(), grad),
            with_frames(json.dumps(good).encode(), [("grad_outputs", codec.encode(self.rng.choice(wrong_grads)))]),
            with_frames(json.dumps(good).encode(), bad_tensors(self.rng, hidden)),
            with_frames(json.dumps(good).encode(), []),
        ])

    async def fuzz_backward(self, hidden: torch.Tensor, other_id: str, expected: torch.Tensor) -> None:
        """Malformed backwards, the valid one of each window (of a forward kept just before) answering `expected`."""
        forwards, backwards = await Stream(self.stub.rpc_forward).start(), await Stream(self.stub.rpc_backward).start()
        for _ in range(PER_KIND // WINDOW):
            kept_id = uuid.uuid4().hex
            forwards.send(self.kept_forward(hidden, kept_id))
            assert (await forwards.reply())[0].kind == MessageKind.OUTPUT
            window = [self.bad_backward(kept_id, other_id, hidden) for _ in range(WINDOW)]
            valid = pack(BackwardMessage(forward_id=kept_id), {"grad_outputs": torch.ones_like(hidden)})
            window.append(valid)  # last: the bad ones before it leave the kept forward in place
            await exchange(backwards, window, valid, "grad_inputs", expected)
            self.sent["backward"] += WINDOW
        assert await forwards.close() == [] and await backwards.close() == []

    # -- inference: open ----------------------------------------------------------------------

    def bad_open(self, taken_id: str):
        good = {"session_id": uuid.uuid4().hex, "start_block": 0, "end_block": NUM_BLOCKS, "max_length": 8, "batch_size": 1}
        invalid = self.rng.choice([
            {"start_block": -1}, {"end_block": 0}, {"end_block": NUM_BLOCKS + 1}, {"start_block": 5, "end_block": 2},
            {"start_block": 3, "end_block": 3}, {"max_length": 0}, {"max_length": -5}, {"batch_size": 0},
            {"session_id": ""}, {"session_id": "x" * 129}, {"surplus": True}, {"link_bandwidth": -1.0},
            {"compression": "maybe"}, {"codecs": 7}, {"start_block": 2 ** 70}])
        refused = self.rng.choice([{"max_length": MAX_LENGTH + 1}, {"max_length": 2 ** 70}, {"batch_size": MAX_BATCH + 1},
                                   {"batch_size": 10 ** 12}, {"session_id": taken_id}])
        return self.rng.choice([
            (with_frames(bad_metadata(self.rng, {"kind": "open", "open": good}), []), ErrorKind.INVALID),
            (with_frames(json.dumps({"kind": "step", "open": good}).encode(), []), ErrorKind.INVALID),
            (with_frames(json.dumps({"kind": "open"}).encode(), []), ErrorKind.INVALID),
            (with_frames(json.dumps({"kind": "open", "open": {**good, **invalid}}).encode(), []), ErrorKind.INVALID),
            (with_frames(json.dumps({"kind": "open", "open": {**good, **refused}}).encode(), []), ErrorKind.REFUSED),
        ])

    async def one_bad_open(self, taken_id: str) -> None:
        request, kind = self.bad_open(taken_id)
        stream = await Stream(self.stub.rpc_inference).start(request)
        assert_error((await stream.reply())[0], kind)
        assert await stream.close() == []

    async def fuzz_open(self, taken_id: str) -> None:
        for _ in range(PER_KIND // VALID_EVERY):
            await asyncio.gather(self.open_and_close(), *(self.one_bad_open(taken_id) for _ in range(VALID_EVERY)))
            self.sent["open"] += VALID_EVERY

    async def open_and_close(self) -> None:
        stream = await self.open_session(uuid.uuid4().hex, 8, 1)
        assert await stream.close() == []

    async def open_session(self, session_id: str, max_length: int, batch_size: int) -> Stream:
        request = OpenSession(session_id=session_id, start_block=0, end_block=NUM_BLOCKS, max_length=max_length,
                              batch_size=batch_size)
        stream = await Stream(self.stub.rpc_inference).start(pack(OpenMessage(open=request)))
        assert (await stream.reply())[0].kind == MessageKind.OPENED
        return stream

    # -- shared streams: bundles --------------------------------------------------------------

    def bad_bundle(self) -> runtime_pb2.ExpertRequest:
        """A bundle that is malformed as a whole: not a bundle, a bad header, or a member that is not an envelope."""
        rng, lane = self.rng, uuid.uuid4().hex
        request = bundle([(lane, self.opening(lane))])
        spoil = rng.choice([
            lambda: setattr(request, "uid", "step"),
            lambda: setattr(request, "metadata", bad_metadata(rng, {"lanes": [lane]})),
            lambda: setattr(request, "metadata", json.dumps({"lanes": [lane, lane]}).encode()),
            lambda: setattr(request, "metadata", json.dumps({"lanes": [rng.choice(["", "x" * 129])]}).encode()),
            lambda: setattr(request.tensors[0], "buffer", rng.choice([b"\x0a\xff", b"\xff\xff\xff", b"\x12\x05ab"])),
            lambda: (request.tensors.extend(runtime_pb2.Tensor() for _ in range(MAX_MEMBERS)),
                     setattr(request, "metadata", json.dumps({"lanes": [lane] * (MAX_MEMBERS + 1)}).encode())),
        ])
        spoil()
        return request

    async def one_bad_bundle(self) -> None:
        stream = await Stream(self.stub.rpc_sessions).start(self.bad_bundle())
        refusal = (await stream.reply())[0]
        assert_error(refusal)
        assert "malformed bundle on a shared stream" in refusal.error, refusal
        assert await stream.close() == []

    async def open_and_close_lane(self) -> None:
        lane = uuid.uuid4().hex
        stream = await Stream(self.stub.rpc_sessions).start(bundle([(lane, self.opening(lane))]))
        [(opened_lane, opened)] = unbundle(await asyncio.wait_for(anext(stream.replies), TIMEOUT))
        assert opened_lane == lane and unpack(opened)[0].kind == MessageKind.OPENED
        stream.send(bundle([(lane, None)]))
        stream.outbox.put_nowait(None)
        rest = await asyncio.wait_for(collect(stream.replies), TIMEOUT)
        assert [member for reply in rest for member in unbundle(reply)] == [(lane, None)]

    async def fuzz_bundles(self) -> None:
        for _ in range(PER_KIND // VALID_EVERY):
            await asyncio.gather(self.open_and_close_lane(), *(self.one_bad_bundle() for _ in range(VALID_EVERY)))
            self.sent["bundle"] += VALID_EVERY

    @staticmethod
    def opening(session_id: str) -> runtime_pb2.ExpertRequest:
        return pack(OpenMessage(open=OpenSession(session_id=session_id, start_block=0, end_block=NUM_BLOCKS,
                                                 max_length=8, batch_size=1)))

    # -- inference: steps, and pushes ---------------------------------------------------------

    def step(self, session_id: str, hidden: torch.Tensor, start: int, step_id: int | None = None, **tensors):
        header = StepHeader(session_id=session_id, step_id=next(self.step_ids) if step_id is None else step_id,
                            start_position=start)
        return pack(StepMessage(step=header), {"hidden": hidden, **tensors})

    def bad_step(self, session_id: str, other_id: str, prefix: torch.Tensor, probe: torch.Tensor):
        """A malformed step (or history request) for `session_id`; `other_id` is another client's session."""
        rng, good = self.rng, {"session_id": session_id, "step_id": next(self.step_ids), "start_position": 4}
        frames = [("hidden", codec.encode(probe))]
        header = rng.choice([{"step_id": -1}, {"start_position": -1}, {"batch_offset": -1}, {"start_position": 2 ** 70},
                             {"batch_offset": 2 ** 64}, {"start_position": SESSION_LENGTH}, {"batch_offset": 1},
                             {"session_id": "no-such-session"}, {"session_id": other_id}, {"session_id": ""},
                             {"route": "nowhere"}, {"route": [{"peer_id": rng.choice(BAD_PEERS), "session_id": "x"}]},
                             {"surplus": 0}])
        unmask_prefix = {"token_mask": torch.zeros(prefix.shape[:2], dtype=torch.bool),
                         "rope_positions": torch.zeros(MAX_BATCH, 3, dtype=torch.long)}
        return rng.choice([
            with_frames(bad_metadata(rng, {"kind": "step", "step": good}), frames),
            with_frames(json.dumps({"kind": rng.choice(["open", "forward", "info", "output"]), "step": good}).encode(), frames),
            with_frames(json.dumps({"kind": "step", "step": {**good, **header}}).encode(), frames),
            with_frames(json.dumps({"kind": "step", "step": good}).encode(), bad_tensors(rng, probe)),
            self.step(session_id, prefix, 0, **unmask_prefix),  # would unmask the prefix if checked after writing
            self.step(session_id, prefix, SESSION_LENGTH - 2, step_id=1),  # repeats step 1, at positions out of range
            self.step(session_id, torch.randn(MAX_BATCH, 4, HIDDEN - 1), 0, step_id=1),  # repeats step 1, too narrow
            with_frames(json.dumps({"kind": "history", "end_position": rng.choice([-1, SESSION_LENGTH + 1])}).encode(), []),
        ])

    async def fuzz_steps(self, stream: Stream, session_id: str, other_id: str, prefix, probe, expected) -> None:
        for _ in range(PER_KIND // WINDOW):
            window = [self.bad_step(session_id, other_id, prefix, probe) for _ in range(WINDOW)]
            valid = {self.rng.randrange(WINDOW): next(self.step_ids) for _ in range(2)}
            for position, step_id in sorted(valid.items(), reverse=True):
                window.insert(position, self.step(session_id, probe, 4, step_id=step_id))
            for request in window:
                stream.send(request)
            await expect_replies(stream, len(window) - len(valid), set(valid.values()), expected)
            self.sent["step"] += WINDOW

    def bad_push(self, session_id: str, other_id: str, probe: torch.Tensor):
        """A malformed push to this client's session or another client's."""
        rng = self.rng
        target = rng.choice([session_id, other_id])
        good = {"session_id": target, "step_id": next(self.step_ids), "start_position": 4}
        frames = [("hidden", codec.encode(probe))]
        header = rng.choice([{"start_position": -1}, {"batch_offset": -1}, {"start_position": 2 ** 70},
                             {"batch_offset": 2 ** 64}, {"start_position": SESSION_LENGTH}, {"batch_offset": 1},
                             {"session_id": "no-such-session"}, {"session_id": ""}, {"surplus": 0},
                             {"route": [{"peer_id": rng.choice(BAD_PEERS), "session_id": "x"}]}])
        return rng.choice([
            with_frames(bad_metadata(rng, {"kind": "step", "step": good}), frames),
            with_frames(json.dumps({"kind": rng.choice(["history", "open", "info"]), "step": good}).encode(), frames),
            with_frames(json.dumps({"kind": "step"}).encode(), frames),
            with_frames(json.dumps({"kind": "step", "step": {**good, **header}}).encode(), frames),
            with_frames(json.dumps({"kind": "step", "step": good}).encode(), bad_tensors(rng, probe)),
            self.step(target, probe, 4, rope_positions=torch.zeros(MAX_BATCH, 2, dtype=torch.long)),
        ])

    async def fuzz_pushes(self, session: Stream, session_id: str, other_id: str, probe, expected) -> None:
        pushes = await Stream(self.stub.rpc_push).start()
        for _ in range(PER_KIND // WINDOW):
            window = [self.bad_push(session_id, other_id, probe) for _ in range(WINDOW)]
            step_id = next(self.step_ids)
            valid = self.step(session_id, probe, 4, step_id=step_id)
            window.insert(self.rng.randrange(WINDOW), valid)
            for request in window:
                pushes.send(request)
            for request in window:
                message = (await pushes.reply())[0]
                if request is valid:
                    assert message.kind == MessageKind.ACK and message.step_id == step_id
                else:
                    assert_error(message)
            await expect_replies(session, 0, {step_id}, expected)  # the session's client hears of its own step only
            self.sent["push"] += WINDOW
        assert await pushes.close() == []


async def exchange(stream: Stream, window: list, valid, name: str, expected: torch.Tensor) -> None:
    """Send `window` down `stream`: the reply to `valid` is an output whose tensor `name` equals `expected`, every
    other reply an error."""
    for request in window:
        stream.send(request)
    for request in window:
        message, tensors = await stream.reply()
        if request is valid:
            assert message.kind == MessageKind.OUTPUT and torch.equal(tensors[name], expected)
        else:
            assert_error(message)


async def expect_replies(stream: Stream, errors: int, step_ids: set[int], expected: torch.Tensor) -> None:
    """Read `errors` typed errors and the outputs of `step_ids` (in any order), each output equal to `expected`."""
    outputs = set()
    for _ in range(errors + len(step_ids)):
        message, tensors = await stream.reply()
        if message.kind == MessageKind.ERROR:
            assert_error(message)
            errors -= 1
        else:
            assert message.kind == MessageKind.OUTPUT and message.step_id in step_ids, message
            assert torch.equal(tensors["hidden"], expected)
            outputs.add(message.step_id)
    assert errors == 0 and outputs == step_ids


async def clean_steps(fuzzer: Fuzzer, stream: Stream, session_id: str, prefix, probe) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 (the prefix, at position 0) and one probe step at position 4 of a session: their outputs."""
    stream.send(fuzzer.step(session_id, prefix, 0, step_id=1))
    stream.send(fuzzer.step(session_id, probe, 4))
    (first, first_tensors), (second, second_tensors) = await stream.reply(), await stream.reply()
    assert first.kind == second.kind == MessageKind.OUTPUT and first.step_id == 1
    return first_tensors["hidden"], second_tensors["hidden"]


async def fuzz_inference(fuzzer: Fuzzer, other: Fuzzer) -> None:
    """Open, steps and pushes: a fuzzed session of this client and another client's session beside it."""
    prefix, probe = torch.randn(MAX_BATCH, 4, HIDDEN), torch.randn(MAX_BATCH, 1, HIDDEN)
    quiet_id, own_id, other_id = (uuid.uuid4().hex for _ in range(3))
    quiet = await fuzzer.open_session(quiet_id, SESSION_LENGTH, MAX_BATCH)
    expected = await clean_steps(fuzzer, quiet, quiet_id, prefix, probe)
    assert await quiet.close() == []
    own = await fuzzer.open_session(own_id, SESSION_LENGTH, MAX_BATCH)
    theirs = await other.open_session(other_id, SESSION_LENGTH, MAX_BATCH)
    for stream, session_id in ((own, own_id), (theirs, other_id)):
        outputs = await clean_steps(fuzzer, stream, session_id, prefix, probe)
        assert all(torch.equal(output, wanted) for output, wanted in zip(outputs, expected))
    await fuzzer.fuzz_open(other_id)
    await fuzzer.fuzz_steps(own, own_id, other_id, prefix, probe, expected[1])
    await fuzzer.fuzz_pushes(own, own_id, other_id, probe, expected[1])
    theirs.send(other.step(other_id, probe, 4, step_id=7))
    await expect_replies(theirs, 0, {7}, expected[1])  # the other client's cache is as it left it, and it heard nothing
    assert await own.close() == [] and await theirs.close() == []


async def fuzz_all(fuzzer: Fuzzer, other: Fuzzer, info_keys: set[str], forward_in, forward_out, backward_out) -> None:
    await fuzzer.fuzz_info(info_keys)
    await fuzzer.fuzz_forward(forward_in, forward_out)
    await fuzz_backward(fuzzer, other, forward_in, backward_out)
    await fuzz_inference(fuzzer, other)
    await fuzzer.fuzz_bundles()


async def fuzz_backward(fuzzer: Fuzzer, other: Fuzzer, hidden: torch.Tensor, expected: torch.Tensor) -> None:
    """`fuzzer`'s backwards, some naming a forward `other` keeps, which stays `other`'s to use."""
    other_id = uuid.uuid4().hex
    await keep_forward(other, hidden, other_id)
    await fuzzer.fuzz_backward(hidden, other_id, expected)
    assert torch.equal(await clean_backward(other, other_id, hidden), expected)


async def keep_forward(fuzzer: Fuzzer, hidden: torch.Tensor, forward_id: str) -> None:
    stream = await Stream(fuzzer.stub.rpc_forward).start(fuzzer.kept_forward(hidden, forward_id))
    assert (await stream.reply())[0].kind == MessageKind.OUTPUT and await stream.close() == []


async def clean_backward(fuzzer: Fuzzer, forward_id: str, hidden: torch.Tensor) -> torch.Tensor:
    request = pack(BackwardMessage(forward_id=forward_id), {"grad_outputs": torch.ones_like(hidden)})
    stream = await Stream(fuzzer.stub.rpc_backward).start(request)
    message, tensors = await stream.reply()
    assert message.kind == MessageKind.OUTPUT and await stream.close() == []
    return tensors["grad_inputs"]


async def server_info(fuzzer: Fuzzer) -> dict:
    return unpack(await fuzzer.stub.rpc_info(pack(InfoMessage()), timeout=TIMEOUT))[0].info


async def clean_forward(fuzzer: Fuzzer, hidden: torch.Tensor) -> torch.Tensor:
    request = pack(ForwardMessage(start_block=0, end_block=NUM_BLOCKS), {"hidden": hidden})
    stream = await Stream(fuzzer.stub.rpc_forward).start(request)
    message, tensors = await stream.reply()
    assert message.kind == MessageKind.OUTPUT and await stream.close() == []
    return tensors["hidden"]


def memory_of(pid: int) -> dict[str, int]:
    """Resident and peak resident bytes of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) << 10 for name in ("VmRSS", "VmHWM")}


def client_round(model, hidden: torch.Tensor) -> list[torch.Tensor]:
    """A real client session stepping `hidden` token by token: its outputs."""
    with model.remote.inference_session(max_length=hidden.shape[1]) as session:
        return [session.step(hidden[:, i:i + 1]) for i in range(hidden.shape[1])]


def client_rounds_until(model, done, hidden: torch.Tensor, expected: list[torch.Tensor]) -> int:
    """Client rounds, each equal to `expected`, until `done` (a future) is; how many ran."""
    rounds = 0
    while not done.done():
        outputs = client_round(model, hidden)
        assert all(torch.equal(output, wanted) for output, wanted in zip(outputs, expected))
        rounds += 1
    return rounds


def wait_for_sessions(fuzzer: Fuzzer, count: int) -> dict:
    """The server's info once it holds `count` sessions (closed streams end their sessions asynchronously)."""
    for _ in range(100):
        info = run_sync(server_info(fuzzer))
        if info["open_sessions"] == count:
            return info
        time.sleep(0.1)
    raise AssertionError(f"the server still holds {info['open_sessions']} sessions, expected {count}")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model") / "fuzz-llama")
    swarm = start_swarm(folder, tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"))
    try:
        swarm.add_server(*SERVER_ARGS, name="a")
        yield swarm
    finally:
        swarm.stop()


async def collect(replies) -> list:
    return [reply async for reply in replies]


def server_peer(swarm) -> str:
    return next(peer_id for records in fetch_records(swarm.dht, swarm.prefix, NUM_BLOCKS) for peer_id in records)


def test_malformed_requests_get_typed_errors_and_change_nothing(swarm):
    torch.manual_seed(0)
    model, peer = client(swarm), server_peer(swarm)
    other_dht = start_dht(swarm.initial_peers, client_mode=True)
    replicas = [run_sync(swarm.dht.replicate_p2p()), run_sync(other_dht.replicate_p2p())]
    try:
        fuzzer, other = Fuzzer(replicas[0], peer, seed=0), Fuzzer(replicas[1], peer, seed=1)
        hidden = model.head.embed(torch.tensor([[5, 9, 2, 7, 1, 3, 8, 4]]))
        expected = client_round(model, hidden)
        forward_in = torch.randn(1, 5, HIDDEN)
        forward_out = run_sync(clean_forward(fuzzer, forward_in))
        run_sync(keep_forward(fuzzer, forward_in, "clean"))
        backward_out = run_sync(clean_backward(fuzzer, "clean", forward_in))
        baseline = wait_for_sessions(fuzzer, 0)
        pid = swarm.server("a").process.pid
        memory = memory_of(pid)
        fuzz = asyncio.run_coroutine_threadsafe(fuzz_all(fuzzer, other, set(baseline), forward_in, forward_out,
                                                         backward_out),
                                                client_loop())
        try:
            rounds = client_rounds_until(model, fuzz, hidden, expected)
        finally:
            fuzz.cancel()
        fuzz.result()
        after = wait_for_sessions(fuzzer, 0)
    finally:
        for replica in replicas:  # its daemon connection, closed on the loop it was opened on
            run_sync(replica.shutdown())
        other_dht.shutdown()
    assert rounds >= 1 and fuzzer.sent == {kind: PER_KIND for kind in ("info", "forward", "backward", "open", "step",
                                                                      "push", "bundle")}
    assert after["kept_forwards"] == {"count": 0, "bytes": 0}
    assert swarm.server("a").process.poll() is None
    for key in ("device_free_bytes", "host_free_bytes", "device_memory_bytes", "host_memory_bytes"):
        assert after[key] == baseline[key]
    assert (after["device_free_bytes"], after["host_free_bytes"]) == (after["device_memory_bytes"], after["host_memory_bytes"])
    grown = {name: size - memory[name] for name, size in memory_of(pid).items()}
    assert all(growth < RSS_GROWTH for growth in grown.values()), grown
