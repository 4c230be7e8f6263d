"""One background asyncio loop per client process, where all P2P calls of the client run."""

import asyncio
import atexit
import threading
from typing import Any, Coroutine

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_THREAD_NAME = "bloombee-client-loop"


def client_loop() -> asyncio.AbstractEventLoop:
    """The process's client loop, started on first use in a daemon thread."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name=_THREAD_NAME, daemon=True).start()
            atexit.register(_stop, loop)
            _loop = loop
        return _loop


def run_sync(coroutine: Coroutine, timeout: float | None = None) -> Any:
    """Run a coroutine on the client loop and wait for its result from a synchronous caller (any other thread)."""
    loop = client_loop()
    if threading.current_thread().name == _THREAD_NAME:
        coroutine.close()
        raise RuntimeError("a blocking client call was made on the client loop itself; await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    """At exit: cancel the loop's tasks (open streams, P2P readers) and stop it."""

    async def cancel_all() -> None:
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=5)
    loop.call_soon_threadsafe(loop.stop)
