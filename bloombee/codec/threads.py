"""Where a codec call runs: a small one on the caller's event loop, a large one in a thread beside it."""

import asyncio
from concurrent.futures import Executor

INLINE_CODEC_BYTES = 16384  # messages up to this size are decoded and encoded on the event loop (a few microseconds)


async def run_codec(executor: Executor | None, num_bytes: int, fn, *args):
    """`fn(*args)` (a decode or an encode of `num_bytes`) in `executor` (None: the loop's default one), or right here
    when it is small: handing it to a thread would cost more than it does, and a busy interpreter lock more still."""
    if num_bytes <= INLINE_CODEC_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
