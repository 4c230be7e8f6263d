"""The tasks reading a client's streams from servers, per client, so that closing the client stops them first: its
p2p connection closing under them would leave their reads pending."""

import asyncio
import weakref

from hivemind.p2p import P2P

# per P2P instance (a client), its readers that have not ended
_READERS: weakref.WeakKeyDictionary[P2P, set[asyncio.Task]] = weakref.WeakKeyDictionary()


def track_reader(p2p: P2P, reader: asyncio.Task) -> None:
    """Count `reader` among the readers of client `p2p` until it ends."""
    readers = _READERS.setdefault(p2p, set())
    readers.add(reader)
    reader.add_done_callback(readers.discard)


async def stop_reading(p2p: P2P) -> None:
    """Cancel the readers of client `p2p` and wait for them to end."""
    readers = list(_READERS.pop(p2p, ()))
    for reader in readers:
        reader.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
