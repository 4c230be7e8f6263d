"""Async iterators that feed hivemind's streaming RPCs."""

import asyncio
from typing import AsyncIterator, TypeVar

Item = TypeVar("Item")


async def queue_stream(queue: asyncio.Queue) -> AsyncIterator:
    """Yield what is put into `queue` until None is put, which ends the stream; an exception put is raised."""
    while True:
        item = await queue.get()
        if item is None:
            return
        if isinstance(item, Exception):
            raise item
        yield item


async def single(item: Item) -> AsyncIterator[Item]:
    """A one-item stream, for stream RPCs that take one request."""
    yield item
