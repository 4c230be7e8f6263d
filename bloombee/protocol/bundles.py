"""Shared streams: one hivemind stream between a client and a server carries all the client's sessions there.

Each session's inference stream becomes a lane of the shared stream, named by the session id the client chose. What
is ready to go at once (the replies of one batched forward, the steps several sessions sent in one turn of the
client's loop) travels as one envelope, a bundle, so that the link, both p2p daemons and both event loops handle one
message where they handled one per session. A lane behaves as its own stream would: its first message opens the
session, an empty member ends it.

A bundle is an envelope whose uid is BUNDLE, whose metadata (`BundleHeader`) names the lane of each member, and
whose tensors hold the members, each a serialized envelope in its buffer.
"""

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Annotated

from google.protobuf.message import DecodeError
from hivemind.proto import runtime_pb2
from pydantic import BaseModel, ConfigDict, Field

from bloombee.protocol.errors import InvalidStep

Envelope = runtime_pb2.ExpertRequest
Member = tuple[str, Envelope | None]  # a lane and its message; None ends the lane
BUNDLE = "bundle"
MAX_MEMBERS = 4096  # members of one bundle


class BundleHeader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lanes: tuple[Annotated[str, Field(min_length=1, max_length=128)], ...] = Field(max_length=MAX_MEMBERS)


def bundle(members: Sequence[Member]) -> Envelope:
    """One envelope of `members`, in order."""
    header = BundleHeader(lanes=tuple(lane for lane, _ in members))
    result = Envelope(uid=BUNDLE, metadata=header.model_dump_json().encode())
    result.tensors.extend(runtime_pb2.Tensor(buffer=b"" if message is None else message.SerializeToString())
                          for _, message in members)
    return result


def unbundle(envelope: Envelope) -> list[Member]:
    """The members of a bundle; raises InvalidStep or a pydantic ValidationError naming what is malformed."""
    if envelope.uid != BUNDLE:
        raise InvalidStep(f"a shared stream carries bundles, not {envelope.uid[:64]!r} messages")
    lanes = BundleHeader.model_validate_json(envelope.metadata).lanes
    if len(lanes) != len(envelope.tensors):
        raise InvalidStep(f"a bundle names {len(lanes)} lanes for {len(envelope.tensors)} members")
    members = []
    for lane, part in zip(lanes, envelope.tensors):
        message = None
        if part.buffer:
            message = Envelope()
            try:
                message.ParseFromString(part.buffer)
            except DecodeError as error:
                raise InvalidStep(f"the member of lane {lane!r} is not an envelope: {error}") from error
        members.append((lane, message))
    return members


async def bundles(outbox: asyncio.Queue) -> AsyncIterator[Envelope]:
    """Bundles of the members put into `outbox`: each of the first that came and of all that followed it within the
    same turn of the event loop (at most MAX_MEMBERS); None ends the stream."""
    while True:
        members = [await outbox.get()]
        await asyncio.sleep(0)
        while members[-1] is not None and not outbox.empty() and len(members) < MAX_MEMBERS:
            members.append(outbox.get_nowait())
        if members[-1] is None:
            if len(members) > 1:
                yield bundle(members[:-1])
            return
        yield bundle(members)
