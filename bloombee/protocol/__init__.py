"""The swarm's wire protocol: typed messages carried in hivemind's runtime protobuf envelopes."""

from bloombee.protocol.messages import (
    PROTOCOL_FEATURES,
    REQUIRED_FEATURES,
    EncodedTensors,
    ErrorKind,
    Hop,
    HopReport,
    Message,
    MessageKind,
    OpenSession,
    StepHeader,
    encode_tensors,
    envelope,
    error_envelope,
    pack,
    unpack,
    unpack_timed,
)

__all__ = [
    "PROTOCOL_FEATURES",
    "REQUIRED_FEATURES",
    "EncodedTensors",
    "ErrorKind",
    "Hop",
    "HopReport",
    "Message",
    "MessageKind",
    "OpenSession",
    "StepHeader",
    "encode_tensors",
    "envelope",
    "error_envelope",
    "pack",
    "unpack",
    "unpack_timed",
]
