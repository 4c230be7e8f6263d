"""Inference sessions held by a server: their KV caches, token masks and output history, and what they hold of
the memory budget."""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bloombee.models.core.kv_cache import KVCache
from bloombee.models.core.offload import OffloadedKVCache
from bloombee.server.memory import MemoryBudget, SessionBytes, SessionRefused

logger = logging.getLogger(__name__)

INBOX_DEPTH = 4  # messages a session holds before the streams feeding it (client, previous server) wait


@dataclass
class Session:
    """One client's state on this server for blocks [start_block, end_block) of the hosted range."""

    session_id: str
    start_block: int
    end_block: int
    batch_size: int
    max_length: int
    caches: list[KVCache | OffloadedKVCache]
    token_mask: torch.Tensor  # [batch, max_length] bool: which written slots hold real tokens
    output_history: torch.Tensor  # [batch, max_length, hidden] on the host: what this server sent on
    reply_codecs: tuple[str, ...] = ()  # codec layouts the client accepts
    client_peer: str = ""
    client_bandwidth: float | None = None  # the client's link, bytes/s, as it told us
    compression: str | None = None  # the client's codec mode for this session ("on"/"off"), else the server's
    adapter: str | None = None  # the LoRA adapter the session's steps compute (None: the base model)
    prompts: torch.Tensor | None = None  # [blocks, prefix, hidden]: deep prompts added at slots < prefix of every row
    push_channel: Any = None  # the PushChannel to the next server, opened on the first push
    inbox: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(INBOX_DEPTH))  # bounded: back-pressure
    last_active: float = field(default_factory=time.monotonic)
    held: SessionBytes = SessionBytes()  # what the session holds of the server's memory budget
    trees: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)  # row -> (first slot, node ids) of its
    # last tree, until the accepted nodes are known and compacted
    rows_version: int = 0  # reorders of the rows applied (StepHeader.rows_version)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the session's tensors by device type: what `held` accounts for."""
        total: dict[str, int] = {}
        for part in [cache.nbytes() for cache in self.caches] + [{t.device.type: t.nbytes} for t in
                                                                 (self.token_mask, self.output_history)]:
            for kind, size in part.items():
                total[kind] = total.get(kind, 0) + size
        return total


class SessionRegistry:
    """Open sessions by id, so that pushes from other servers find their session."""

    def __init__(self, budget: MemoryBudget, on_change: Callable[[], None] = lambda: None):
        self.budget = budget
        self.on_change = on_change  # called when a session opens or closes
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def add(self, session: Session) -> None:
        if session.session_id in self._sessions:
            raise SessionRefused(f"session id {session.session_id!r} is already open on this server; use a fresh id")
        self._sessions[session.session_id] = session
        self.on_change()

    def remove(self, session: Session) -> None:
        if self._sessions.pop(session.session_id, None) is not None:
            self.budget.release(session.held)
            self.on_change()
            logger.info("Closed session %s; free: %s", session.session_id, self.budget.free)
