"""Messages between clients and servers, and their packing into hivemind protobuf envelopes.

Every message is a pydantic header (JSON in the envelope's metadata) plus named tensors, each
tensor a `bloombee.codec` frame in the envelope's tensor buffer. The header is one model per kind
(`Message`, a union discriminated by `kind`). Steps carry explicit cache positions, a batch offset,
the tensors of their kind (`bloombee.protocol.steps`), and the rest of the chain, so that a server
can push its output straight to the next server.
"""

import time
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from bloombee import codec
from bloombee.codec import CompressionPolicy
from bloombee.protocol.errors import InvalidStep


class MessageKind(str, Enum):
    OPEN = "open"  # client -> server: open a session (OpenSession)
    OPENED = "opened"  # server -> client: the session's cache is allocated
    STEP = "step"  # client or previous server -> server: hidden states for some positions (StepHeader)
    OUTPUT = "output"  # last server -> client: the chain's output for a step
    ACK = "ack"  # server -> pushing server: the pushed step was queued
    HISTORY = "history"  # client -> server: send back your outputs for positions [0, end); server -> client: them
    FORWARD = "forward"  # client -> server: stateless forward over the given blocks
    BACKWARD = "backward"  # client -> server: gradients through a forward the server kept
    INFO = "info"  # client -> server: describe yourself; server -> client: the description
    ERROR = "error"  # any direction: what went wrong


class ErrorKind(str, Enum):
    INVALID = "invalid"  # the request was wrong; retrying elsewhere will not help
    REFUSED = "refused"  # the server cannot take it now (limits, cache budget); another server may
    EXPIRED = "expired"  # the session sat idle too long and its cache was freed; open it again
    PEER_FAILED = "peer_failed"  # the next server of the chain could not be reached
    INTERNAL = "internal"  # the server failed to compute


class Hop(BaseModel):
    """One server further down the chain, the session the client opened there, and its link."""

    model_config = ConfigDict(extra="forbid")
    peer_id: str
    session_id: str
    codecs: tuple[str, ...] = ()
    link_bandwidth: float | None = None
    decode_speed: float | None = Field(None, gt=0, description="this server's measured decode speed, raw bytes/s")

    @field_validator("peer_id")
    @classmethod
    def _is_peer_id(cls, value: str) -> str:
        """A base58 multihash, as a server's peer id is (a step is pushed to it)."""
        digest = PeerID.from_base58(value).to_bytes()  # raises ValueError naming a character that is not base58
        if len(digest) < 2 or digest[1] != len(digest) - 2:
            raise ValueError(f"{value[:64]!r} is not a peer id")
        return value


class HopReport(BaseModel):
    """What one server did with one step: decode its input, compute, encode what it sent on."""

    model_config = ConfigDict(extra="forbid")
    peer_id: str = ""
    layout: str = "raw"
    raw_bytes: int = 0
    wire_bytes: int = 0
    decode_s: float = 0.0
    decode_cpu_s: float = 0.0  # CPU seconds of the decode alone, in its thread (what decode speeds are learned from)
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0  # CPU seconds of the compute thread in it (on a GPU: launching kernels, not running them)
    encode_s: float = 0.0
    batch_offset: int = 0  # the micro-batch's first row
    decode_at: float = 0.0  # wall-clock time (time.time()) each part began, for timelines
    compute_at: float = 0.0
    encode_at: float = 0.0
    duplicate: bool = False  # the step had come before: not computed again, its earlier output sent on
    nodes: int = 0  # tree steps: the tree nodes this server sent on (after its pruning)


class OpenSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str = Field(min_length=1, max_length=128)
    start_block: int = Field(ge=0)
    end_block: int = Field(gt=0)
    max_length: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    codecs: tuple[str, ...] = ()
    link_bandwidth: float | None = Field(None, gt=0, description="the client's link, bytes/s")
    compression: Literal["on", "off"] | None = Field(
        None, description="the client's codec mode for what this server sends in the session, over its --compression")
    adapter: str | None = Field(None, min_length=1, max_length=1024, description="the LoRA adapter the session "
                                "computes, by the name its servers were given (None: the base model)")


class StepHeader(BaseModel):
    """One step of a session: which slots the tokens go to and where the output goes next."""

    model_config = ConfigDict(extra="forbid")
    session_id: str
    step_id: int = Field(ge=0)
    start_position: int = Field(ge=0)
    batch_offset: int = Field(0, ge=0)
    route: tuple[Hop, ...] = ()
    reply: bool = True
    reply_decode_speed: float | None = Field(None, gt=0, description="the client's measured decode speed, raw bytes/s")
    reports: tuple[HopReport, ...] = ()  # what the servers before this one did with the step
    prune_tau: float | None = Field(None, ge=0, description="tree steps: the first server that can drops the "
                                    "candidates whose keep score is below this, with their descendants")
    compact_start: int | None = Field(None, ge=0, description="before this step, keep only the accepted nodes "
                                      "(compact_ids, compact_offsets) of the tree written from this slot")
    rows_version: int = Field(0, ge=0, description="how many times the session's rows have been reordered when "
                              "this step computes (0: as opened)")
    reorder: tuple[int, ...] | None = Field(None, description="before this step, row i continues row reorder[i] "
                                            "(beam search): the rows go from rows_version - 1 to rows_version")


class _Message(BaseModel):
    """What every kind of message has: `reports`, per server of the chain so far in chain order, which replies to
    steps fill; the other kinds carry it empty, as every message of earlier versions did."""

    model_config = ConfigDict(extra="forbid")
    kind: MessageKind  # each kind's model narrows it to its own
    reports: tuple[HopReport, ...] = ()


class OpenMessage(_Message):
    """Client -> server: open a session."""

    kind: Literal[MessageKind.OPEN] = MessageKind.OPEN
    open: OpenSession


class OpenedMessage(_Message):
    """Server -> client: the session's cache is allocated; `info` says how much room is left."""

    kind: Literal[MessageKind.OPENED] = MessageKind.OPENED
    info: dict[str, Any]


class StepMessage(_Message):
    """Client or previous server -> server: a step of a session, its tensors those of its kind."""

    kind: Literal[MessageKind.STEP] = MessageKind.STEP
    step: StepHeader


class _StepReply(_Message):
    step_id: int | None = None
    batch_offset: int | None = None  # the micro-batch's first row


class OutputMessage(_StepReply):
    """Last server -> client: the chain's output of a step (or of a stateless forward)."""

    kind: Literal[MessageKind.OUTPUT] = MessageKind.OUTPUT


class AckMessage(_StepReply):
    """Server -> client or pushing server: the step was queued, or sent on."""

    kind: Literal[MessageKind.ACK] = MessageKind.ACK


class HistoryMessage(_StepReply):
    """Client -> server: send back your outputs for positions [start_position, end_position); server -> client:
    them."""

    kind: Literal[MessageKind.HISTORY] = MessageKind.HISTORY
    start_position: int = Field(0, ge=0)
    end_position: int
    rows_version: int = Field(0, ge=0, description="the rows' reorders the history should reflect")
    reorder: tuple[int, ...] | None = Field(None, description="the client's: the reorder to rows_version, which the "
                                            "server may not have applied yet (StepHeader.reorder)")


class ForwardMessage(_Message):
    """Client -> server: a stateless forward over blocks [start_block, end_block), the reply in one of `codecs`;
    with `forward_id`, the server keeps its inputs for a backward naming that id."""

    kind: Literal[MessageKind.FORWARD] = MessageKind.FORWARD
    start_block: int
    end_block: int
    codecs: tuple[str, ...] | None = None
    forward_id: str | None = Field(None, min_length=1, max_length=128)
    adapter: str | None = Field(None, min_length=1, max_length=1024, description="as OpenSession.adapter")


class BackwardMessage(_Message):
    """Client -> server: the gradients of the inputs (and deep prompts) of the forward the server kept as
    `forward_id`, given its outputs' gradients; the server forgets that forward."""

    kind: Literal[MessageKind.BACKWARD] = MessageKind.BACKWARD
    forward_id: str = Field(min_length=1, max_length=128)
    codecs: tuple[str, ...] | None = None


class InfoMessage(_Message):
    """Client -> server: describe yourself (no info); server -> client: the description."""

    kind: Literal[MessageKind.INFO] = MessageKind.INFO
    info: dict[str, Any] | None = None


class ErrorMessage(_Message):
    """Any direction: what went wrong, with the step it concerns and the peer that failed, if any."""

    kind: Literal[MessageKind.ERROR] = MessageKind.ERROR
    error_kind: ErrorKind
    error: str
    step_id: int | None = None
    failed_peer: str | None = None


Message = Annotated[OpenMessage | OpenedMessage | StepMessage | OutputMessage | AckMessage | HistoryMessage
                    | ForwardMessage | BackwardMessage | InfoMessage | ErrorMessage, Field(discriminator="kind")]
_MESSAGE = TypeAdapter(Message)


def parse_message(metadata: bytes | str, *expected: type[_Message]) -> Message:
    """The message an envelope's metadata holds (pydantic's ValidationError if malformed); InvalidStep if it is not
    one of the `expected` kinds, when they are given."""
    message = _MESSAGE.validate_json(metadata)
    if expected and not isinstance(message, expected):
        kinds = " or ".join(repr(kind.model_fields["kind"].default.value) for kind in expected)
        raise InvalidStep(f"expected a message of kind {kinds}, got {message.kind.value!r}")
    return message


@dataclass
class EncodedTensors:
    """Frames ready for an envelope, with what encoding them cost."""

    frames: list[runtime_pb2.Tensor]
    layout: str  # the layout of the largest tensor
    raw_bytes: int
    wire_bytes: int
    seconds: float


def encode_tensors(tensors: dict[str, torch.Tensor] | None, policy: CompressionPolicy | None = None) -> EncodedTensors:
    """Encode named tensors: raw without a policy, else as the link's policy decides."""
    began = time.perf_counter()
    frames, layout, largest, raw_bytes = [], "raw", -1, 0
    for name, tensor in (tensors or {}).items():
        frame = codec.encode(tensor, "raw") if policy is None else policy.encode(tensor)
        frames.append(runtime_pb2.Tensor(buffer=frame, dtype=name))
        size = tensor.numel() * tensor.element_size()
        raw_bytes += size
        if size > largest:
            largest, layout = size, codec.frame_layout(frame)
    wire_bytes = sum(len(frame.buffer) for frame in frames)
    return EncodedTensors(frames, layout, raw_bytes, wire_bytes, time.perf_counter() - began)


def envelope(message: Message, frames: list[runtime_pb2.Tensor] = ()) -> runtime_pb2.ExpertRequest:
    result = runtime_pb2.ExpertRequest(uid=message.kind.value, metadata=message.model_dump_json(exclude_none=True).encode())
    result.tensors.extend(frames)
    return result


def error_envelope(kind: ErrorKind, text: str, step_id: int | None = None,
                   failed_peer: str | None = None) -> runtime_pb2.ExpertRequest:
    """An error message of `kind` about step `step_id` (and the peer that failed, if one did)."""
    return envelope(ErrorMessage(error_kind=kind, error=text, step_id=step_id, failed_peer=failed_peer))


def pack(message: Message, tensors: dict[str, torch.Tensor] | None = None,
         policy: CompressionPolicy | None = None) -> runtime_pb2.ExpertRequest:
    """Envelope for a message and its tensors (raw, or as `policy` decides)."""
    return envelope(message, encode_tensors(tensors, policy).frames)


def unpack(envelope: runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse, max_bytes: int = codec.DEFAULT_MAX_BYTES,
           names: tuple[str, ...] | None = None) -> tuple[Message, dict[str, torch.Tensor]]:
    """Message header and decoded tensors of an envelope, which may hold at most `max_bytes` of tensors in all and,
    when `names` is given, only tensors so named; raises a ValidationError, CodecError or InvalidStep naming what is
    malformed."""
    message, tensors, _ = unpack_timed(envelope, max_bytes, names)
    return message, tensors


def unpack_timed(envelope: runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse,
                 max_bytes: int = codec.DEFAULT_MAX_BYTES,
                 names: tuple[str, ...] | None = None) -> tuple[Message, dict[str, torch.Tensor], float]:
    """`unpack`, and the CPU seconds this thread spent decoding the tensors (what the codec policies learn decode
    speeds from: see `CompressionPolicy`)."""
    message = parse_message(envelope.metadata)
    tensors, cpu_s = {}, 0.0
    for proto in envelope.tensors:
        if names is not None and proto.dtype not in names:
            raise InvalidStep(f"unexpected tensor {proto.dtype[:64]!r}: a {message.kind.value} message carries "
                              f"{list(names)}")
        if proto.dtype in tensors:
            raise InvalidStep(f"tensor {proto.dtype[:64]!r} appears twice in one message")
        began = time.thread_time()
        tensors[proto.dtype] = codec.decode(proto.buffer, max_bytes=max_bytes)
        cpu_s += time.thread_time() - began
        max_bytes -= tensors[proto.dtype].nbytes
    return message, tensors, cpu_s
