"""Inference sessions held by a server: their KV caches, token masks, output history, and the cache budget."""

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bloombee.models.core.kv_cache import KVCache

logger = logging.getLogger(__name__)

INBOX_DEPTH = 4  # messages a session holds before the streams feeding it (client, previous server) wait


class SessionRefused(Exception):
    """The server cannot open this session (a limit or the cache budget); the message says which."""


class CacheBudget:
    """Counts KV-cache tokens (batch x length) handed to sessions against the server's budget."""

    def __init__(self, total_tokens: int):
        self.total_tokens = total_tokens
        self._used = 0
        self._lock = threading.Lock()

    @property
    def tokens_left(self) -> int:
        return self.total_tokens - self._used

    def reserve(self, tokens: int) -> None:
        with self._lock:
            if tokens > self.total_tokens - self._used:
                raise SessionRefused(
                    f"the server's KV cache has room for {self.total_tokens - self._used} more tokens "
                    f"(batch x max_length) but the session asks for {tokens}; ask for a shorter max_length "
                    f"or smaller batch, or use another server"
                )
            self._used += tokens

    def release(self, tokens: int) -> None:
        with self._lock:
            self._used -= tokens


@dataclass
class Session:
    """One client's state on this server for blocks [start_block, end_block) of the hosted range."""

    session_id: str
    start_block: int
    end_block: int
    batch_size: int
    max_length: int
    caches: list[KVCache]
    token_mask: torch.Tensor  # [batch, max_length] bool: which written slots hold real tokens
    output_history: torch.Tensor  # [batch, max_length, hidden] on the host: what this server sent on
    reply_codecs: tuple[str, ...] = ()  # codec layouts the client accepts
    client_peer: str = ""
    client_bandwidth: float | None = None  # the client's link, bytes/s, as it told us
    compression: str | None = None  # the client's codec mode for this session ("on"/"off"), else the server's
    push_channel: Any = None  # the PushChannel to the next server, opened on the first push
    inbox: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(INBOX_DEPTH))  # bounded: back-pressure
    last_active: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return self.batch_size * self.max_length


class SessionRegistry:
    """Open sessions by id, so that pushes from other servers find their session."""

    def __init__(self, budget: CacheBudget):
        self.budget = budget
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def add(self, session: Session) -> None:
        if session.session_id in self._sessions:
            raise SessionRefused(f"session id {session.session_id!r} is already open on this server; use a fresh id")
        self._sessions[session.session_id] = session

    def remove(self, session: Session) -> None:
        if self._sessions.pop(session.session_id, None) is not None:
            self.budget.release(session.tokens)
            logger.info("Closed session %s, %d cache tokens left", session.session_id, self.budget.tokens_left)
