"""Freeing what a client started: its DHT peer (a child process with the p2p daemon) and its p2p connection."""

import asyncio
import logging
from concurrent.futures import Future

import hivemind
from hivemind.p2p import P2P

from bloombee.client.loop import client_loop
from bloombee.client.readers import stop_reading

logger = logging.getLogger(__name__)


def release(dht: hivemind.DHT, p2p: P2P | None) -> None:
    """Close the client's p2p connection (on the client loop, not waited for: this may run on that loop, from a
    finalizer) and shut the DHT peer down, its child process and p2p daemon with it."""
    if p2p is not None:
        asyncio.run_coroutine_threadsafe(_close(p2p), client_loop()).add_done_callback(_log_failure)
    dht.shutdown()


async def _close(p2p: P2P) -> None:
    """Stop reading the client's streams, then close its p2p connection."""
    await stop_reading(p2p)
    await p2p.shutdown()


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("Closing the client's p2p connection failed: %r", future.exception())
