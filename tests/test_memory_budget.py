"""The server's memory budget: byte sizes, a fair queue, refusals that name the budget, and sessions' real bytes."""

import asyncio

import pytest
import torch

from bloombee.loading import load_block_stack
from bloombee.server.backend import BlockBackend
from bloombee.server.memory import MemoryBudget, SessionBytes, SessionRefused, parse_bytes


def test_parse_bytes_reads_binary_and_decimal_units_and_names_a_bad_size():
    assert [parse_bytes(text) for text in ("512", "2KiB", "1.5GiB", "3G", "2GB", "10 mb")] == \
        [512, 2048, 3 << 29, 3 << 30, 2 * 10**9, 10**7]
    with pytest.raises(ValueError, match="'lots' is not a memory size; write e.g. 24GiB"):
        parse_bytes("lots")


def test_sessions_wait_in_arrival_order_and_a_timeout_hands_room_on():
    async def scenario():
        budget = MemoryBudget(100, 100)
        await budget.reserve(SessionBytes(60, 0), timeout=1)
        big = asyncio.create_task(budget.reserve(SessionBytes(60, 0), timeout=0.2))
        small = asyncio.create_task(budget.reserve(SessionBytes(30, 0), timeout=5))
        await asyncio.sleep(0.05)
        assert not small.done() and budget.waiting == 2  # it would fit, but it came after the big one
        with pytest.raises(SessionRefused, match=r"had only 40 B .* free for 0.2 s \(--alloc-timeout\)"):
            await big
        await small  # the big one gave up: the small one is next and fits
        assert budget.used == SessionBytes(90, 0) and budget.waiting == 0
        budget.release(SessionBytes(60, 0))
        budget.release(SessionBytes(30, 0))
        assert budget.used == SessionBytes()

    asyncio.run(scenario())


def test_a_session_larger_than_the_budget_is_refused_at_once():
    async def scenario():
        with pytest.raises(SessionRefused, match=r"needs 2.00 KiB of cuda memory .* budget is 1.00 KiB of cuda memory"):
            await MemoryBudget(1024, 1 << 20, "cuda").reserve(SessionBytes(2048, 0), timeout=10)

    asyncio.run(scenario())


def test_a_cancelled_wait_leaves_nothing_taken():
    async def scenario():
        budget = MemoryBudget(100, 100)
        await budget.reserve(SessionBytes(80, 0), timeout=1)
        waiting = asyncio.create_task(budget.reserve(SessionBytes(50, 10), timeout=5))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        budget.release(SessionBytes(80, 0))
        assert budget.used == SessionBytes() and budget.waiting == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("offload", [0.0, 0.5, 1.0])
def test_a_sessions_accounted_bytes_are_those_of_its_tensors(offload, tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    backend = BlockBackend(load_block_stack(folder, 0, 4), torch.device("cpu"), torch.float32, offload)
    session = backend.new_session("s", 1, 3, batch_size=3, max_length=40)
    held = backend.session_bytes(1, 3, 3, 40)
    assert session.held == held and session.nbytes() == {"cpu": held.device + held.host}
    assert held.host > 0 and (held.device == 0) == (offload == 1.0)
