"""The swarm's wire protocol: typed messages carried in hivemind's runtime protobuf envelopes."""

from bloombee.protocol.messages import (
    PROTOCOL_FEATURES,
    ErrorKind,
    Hop,
    Message,
    MessageKind,
    OpenSession,
    StepHeader,
    pack,
    unpack,
)

__all__ = [
    "PROTOCOL_FEATURES",
    "ErrorKind",
    "Hop",
    "Message",
    "MessageKind",
    "OpenSession",
    "StepHeader",
    "pack",
    "unpack",
]
