"""Messages between clients and servers, and their packing into hivemind protobuf envelopes.

Every message is a pydantic header (JSON in the envelope's metadata) plus named tensors, each
tensor a `bloombee.codec` frame in the envelope's tensor buffer. Steps carry explicit cache
positions, a batch offset, optional per-token masks / rope positions / tree masks, and the rest of
the chain, so that a server can push its output straight to the next server.
"""

from enum import Enum
from typing import Any, Iterable

import torch
from hivemind.proto import runtime_pb2
from pydantic import BaseModel, ConfigDict, Field

from bloombee import codec

PROTOCOL_FEATURES = ("push", "explicit_positions", "batch_offset", "token_mask", "rope_positions", "history")


class MessageKind(str, Enum):
    OPEN = "open"  # client -> server: open a session (OpenSession)
    OPENED = "opened"  # server -> client: the session's cache is allocated
    STEP = "step"  # client or previous server -> server: hidden states for some positions (StepHeader)
    OUTPUT = "output"  # last server -> client: the chain's output for a step
    ACK = "ack"  # server -> pushing server: the pushed step was queued
    HISTORY = "history"  # client -> server: send back your outputs for positions [0, end); server -> client: them
    FORWARD = "forward"  # client -> server: stateless forward over the given blocks
    INFO = "info"  # client -> server: describe yourself; server -> client: the description
    ERROR = "error"  # any direction: what went wrong


class ErrorKind(str, Enum):
    INVALID = "invalid"  # the request was wrong; retrying elsewhere will not help
    REFUSED = "refused"  # the server cannot take it now (limits, cache budget); another server may
    EXPIRED = "expired"  # the session sat idle too long and its cache was freed; open it again
    PEER_FAILED = "peer_failed"  # the next server of the chain could not be reached
    INTERNAL = "internal"  # the server failed to compute


class Hop(BaseModel):
    """One server further down the chain and the session the client opened there."""

    model_config = ConfigDict(extra="forbid")
    peer_id: str
    session_id: str
    codecs: tuple[str, ...] = ()


class OpenSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str = Field(min_length=1, max_length=128)
    start_block: int = Field(ge=0)
    end_block: int = Field(gt=0)
    max_length: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    codecs: tuple[str, ...] = ()


class StepHeader(BaseModel):
    """One step of a session: which slots the tokens go to and where the output goes next."""

    model_config = ConfigDict(extra="forbid")
    session_id: str
    step_id: int = Field(ge=0)
    start_position: int = Field(ge=0)
    batch_offset: int = Field(0, ge=0)
    route: tuple[Hop, ...] = ()
    reply: bool = True


class Message(BaseModel):
    """Header of any envelope: its kind plus the kind-specific fields."""

    model_config = ConfigDict(extra="forbid")
    kind: MessageKind
    open: OpenSession | None = None
    step: StepHeader | None = None
    step_id: int | None = None
    end_position: int | None = None
    start_block: int | None = None
    end_block: int | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    failed_peer: str | None = None
    info: dict[str, Any] | None = None


def pack(
    message: Message,
    tensors: dict[str, torch.Tensor] | None = None,
    accepted: Iterable[str] | None = None,
    layout: str = "raw",
) -> runtime_pb2.ExpertRequest:
    """Envelope for a message; tensors are encoded with `layout`, or raw where the receiver does not accept it."""
    envelope = runtime_pb2.ExpertRequest(uid=message.kind.value, metadata=message.model_dump_json(exclude_none=True).encode())
    for name, tensor in (tensors or {}).items():
        frame = codec.encode(tensor, layout, accepted=None if accepted is None else tuple(accepted))
        envelope.tensors.append(runtime_pb2.Tensor(buffer=frame, dtype=name))
    return envelope


def unpack(envelope: runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse) -> tuple[Message, dict[str, torch.Tensor]]:
    """Message header and decoded tensors of an envelope; raises ValueError naming what is malformed."""
    message = Message.model_validate_json(envelope.metadata)
    tensors = {proto.dtype: codec.decode(proto.buffer) for proto in envelope.tensors}
    return message, tensors
