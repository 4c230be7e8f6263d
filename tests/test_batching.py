"""Steps of several sessions in one forward (bloombee.server.backend.BlockBackend.run) give each session what it gets
alone, bit for bit, once the blocks are batch-invariant (bloombee.models.core.invariance); a step that fails to
prepare is refused alone."""

import asyncio

import pytest
import torch

from bloombee.loading import load_block_stack, resolve_model
from bloombee.models.core.invariance import (CHUNK_SIZES, ChunkRange, choose_range, chunk_linear_rows, chunk_sizes,
                                              make_batch_invariant, row_range, unchunk_linear_rows)
from bloombee.models.core.packing import pack
from bloombee.protocol import InvalidStep
from bloombee.server.backend import BlockBackend
from bloombee.server.batching import BatchLimits, StepBatcher
from bloombee.speculative.tree import PackedTrees, TokenTree

MAX_LENGTH = 64


def backend_of(dtype: torch.dtype) -> BlockBackend:
    stack = load_block_stack(resolve_model("bloombee-tiny"), 0, 8, dtype=dtype)
    cpu = torch.device("cpu")
    assert make_batch_invariant(stack, stack.dtype, cpu, row_range(stack, stack.dtype, cpu))
    return BlockBackend(stack, "cpu", stack.dtype)


def random_hidden(rows: int, tokens: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, tokens, 256, generator=torch.Generator().manual_seed(seed)).to(dtype)


def a_tree(seed: int) -> PackedTrees:
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    tokens = torch.randint(3, 4000, (6,), generator=torch.Generator().manual_seed(seed))
    return PackedTrees.of([TokenTree(tokens, parents)])


def session_steps(backend: BlockBackend, name: str, seed: int, dtype: torch.dtype):
    """A session's steps, each a function that prepares it: a 2-row prompt of 7 + seed tokens, 3 decode steps, a tree."""
    session = backend.new_session(name, 0, 8, 2, MAX_LENGTH)
    prompt = 7 + seed
    steps = [lambda: backend.prepare_step(session, random_hidden(2, prompt, seed, dtype), 0, 0, None, None)]
    for i in range(3):
        steps.append(lambda i=i: backend.prepare_step(session, random_hidden(2, 1, 100 * seed + i, dtype),
                                                      prompt + i, 0, None, None))
    tree = a_tree(seed)
    steps.append(lambda: backend.prepare_tree_step(session, random_hidden(1, 6, seed + 7, dtype)[0], prompt + 3, 1,
                                                   tree, None))
    return steps


def outputs(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sessions_batched_together_get_what_they_get_alone_bit_for_bit(dtype):
    backend = backend_of(dtype)
    alone = {seed: [outputs(backend.run_one(prepare())) for prepare in session_steps(backend, f"alone{seed}", seed, dtype)]
             for seed in range(4)}
    together = {seed: session_steps(backend, f"together{seed}", seed, dtype) for seed in range(4)}
    got: dict[int, list[torch.Tensor]] = {seed: [] for seed in together}
    # step i of session s runs in forward i + s: prompts beside decode steps beside trees, 1 to 4 sessions at once
    for forward in range(8):
        batch = [(seed, steps[forward - seed]) for seed, steps in together.items() if 0 <= forward - seed < len(steps)]
        results = backend.run([prepare() for _, prepare in batch])
        for (seed, _), result in zip(batch, results):
            got[seed].append(outputs(result))
    for seed in together:
        assert all(torch.equal(a, b) for a, b in zip(alone[seed], got[seed], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_steps_nodes_get_the_bits_of_the_same_tokens_decoded_one_at_a_time(dtype):
    backend = backend_of(dtype)
    prompt, path = random_hidden(1, 9, 0, dtype), random_hidden(1, 3, 1, dtype)[0]  # the tree's root, child, grandchild
    plain = backend.new_session("plain", 0, 8, 1, MAX_LENGTH)
    backend.step(plain, prompt, 0, 0, None, None)
    decoded = [backend.step(plain, path[depth].view(1, 1, -1), 9 + depth, 0, None, None)[0, 0] for depth in range(3)]
    # root 0; children 1 (on the path) and 2; 1's children 3 (on the path) and 4; 2's child 5
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    others = random_hidden(1, 3, 2, dtype)[0]
    nodes = torch.stack([path[0], path[1], others[0], path[2], others[1], others[2]])
    trees = PackedTrees.of([TokenTree(torch.arange(6), parents)])
    speculative = backend.new_session("speculative", 0, 8, 1, MAX_LENGTH)
    backend.step(speculative, prompt, 0, 0, None, None)
    out, _ = backend.tree_step(speculative, nodes, 9, 0, trees, None)
    assert all(torch.equal(out[node], decoded[depth]) for depth, node in enumerate((0, 1, 3)))


def test_chunked_linear_layers_give_a_row_the_same_bits_among_any_number_of_rows():
    stack = load_block_stack(resolve_model("bloombee-tiny"), 0, 1, dtype=torch.float32)
    cpu = torch.device("cpu")
    chunks = row_range(stack, torch.float32, cpu)  # from 4 on some x86 CPUs here, 16 on others: measured
    assert make_batch_invariant(stack, torch.float32, cpu, chunks)
    layer = stack.blocks[0].mlp.down_proj
    inputs = torch.randn(700, layer.in_features, generator=torch.Generator().manual_seed(1))
    probe, others = inputs[:1], inputs[1:]
    with torch.inference_mode():
        alone = layer(probe)[0]
        for rows in (2, 3, 10, 100, 700):
            for where in (0, rows // 2, rows - 1):
                assert torch.equal(layer(torch.cat([others[:where], probe, others[where:rows - 1]]))[where], alone)


def timed_range(floor: int, ceiling: int, call_s: float, row_s: float) -> ChunkRange:
    """A chunk range whose matmuls take `call_s` seconds each and `row_s` more per row."""
    sizes = [size for size in CHUNK_SIZES if floor <= size <= ceiling]
    return ChunkRange(floor, ceiling, tuple(call_s + row_s * size for size in sizes))


def test_rows_go_in_chunks_of_the_range_padded_where_that_is_faster():
    per_row = timed_range(4, 512, 1e-6, 1e-6)  # a row costs as much as a call: left-over rows split
    assert chunk_sizes(1100, per_row) == (512, 512, 64, 8, 4)
    assert chunk_sizes(10, per_row) == (8, 4) and chunk_sizes(10, timed_range(16, 512, 1e-6, 1e-6)) == (16,)
    per_call = timed_range(1, 512, 40e-6, 0.1e-6)  # a bfloat16 matmul of a small model on a CPU: rows nearly free
    assert chunk_sizes(3, per_call) == (4,) and chunk_sizes(48, per_call) == (64,)
    assert chunk_sizes(1100, per_call) == (512, 512, 128) and chunk_sizes(300, per_call) == (512,)
    assert chunk_sizes(48, timed_range(1, 512, 40e-6, 0.5e-6)) == (64,)
    assert chunk_sizes(300, timed_range(1, 512, 40e-6, 0.5e-6)) == (256, 64)
    assert chunk_sizes(100, timed_range(1, 32, 40e-6, 0.1e-6)) == (32, 32, 32, 4)


def test_the_range_measures_its_matmuls_at_every_size():
    stack = load_block_stack(resolve_model("bloombee-tiny"), 0, 1, dtype=torch.bfloat16)
    chunks = row_range(stack, torch.bfloat16, torch.device("cpu"))
    assert chunks is not None
    assert len(chunks.seconds) == chunks.ceiling.bit_length() - chunks.floor.bit_length() + 1
    assert all(seconds > 0 for seconds in chunks.seconds)


def test_the_range_chosen_pads_a_decode_step_least_while_its_chunks_stay_large():
    index = {size: position for position, size in enumerate(CHUNK_SIZES)}

    def runs(*classes: tuple[int, int]) -> set[tuple[int, int]]:
        """Every run within each class of sizes [low, high] that round alike."""
        return {(first, last) for low, high in classes for first in range(index[low], index[high] + 1)
                for last in range(first, index[high] + 1)}

    assert choose_range(runs((1, 512))) == (1, 512)
    assert choose_range(runs((1, 1), (2, 8), (16, 512))) == (16, 512)  # float32 on one CPU here
    assert choose_range(runs((1, 32), (64, 256), (512, 512))) == (1, 32)  # bfloat16, hidden 2048
    assert choose_range(runs((1, 4), (8, 16))) == (8, 16)
    assert choose_range(set()) is None


def test_chunking_is_undone_for_a_server_that_finds_it_too_slow():
    stack = load_block_stack(resolve_model("bloombee-tiny"), 0, 1, dtype=torch.float32)
    layer = stack.blocks[0].mlp.down_proj
    chunk_linear_rows(stack, timed_range(4, 512, 1e-6, 1e-6))
    assert "forward" in vars(layer)
    unchunk_linear_rows(stack)
    assert "forward" not in vars(layer) and type(layer).forward is torch.nn.Linear.forward


def test_a_step_that_fails_to_prepare_is_refused_alone():
    backend = backend_of(torch.float32)
    good = backend.new_session("good", 0, 8, 1, MAX_LENGTH)
    bad = backend.new_session("bad", 0, 8, 1, MAX_LENGTH)
    hidden = random_hidden(1, 4, 0, torch.float32)
    expected = backend.step(backend.new_session("reference", 0, 8, 1, MAX_LENGTH), hidden, 0, 0, None, None)
    with pytest.raises(InvalidStep, match="exceed the session's max_length"):
        backend.prepare_step(bad, hidden, MAX_LENGTH - 1, 0, None, None)
    assert torch.equal(backend.run([backend.prepare_step(good, hidden, 0, 0, None, None)])[0], expected)
    assert not bad.token_mask.any()  # nothing of the refused step was written


@pytest.mark.parametrize("variant", ["mixtral", "gpt-oss", "deepseek-v3"])
def test_a_mixtures_rows_get_the_same_bits_among_any_number_of_rows(variant, tiny_checkpoint):
    """Routers and experts that are not linear layers (gpt-oss's packed experts, DeepSeek-V3's float32 router) are
    chunked as the linear layers are: a row is routed and computed alike whatever rows come with it."""
    folder, _ = tiny_checkpoint(variant, 2)
    stack = load_block_stack(folder, 0, 2, dtype=torch.float32)
    cpu = torch.device("cpu")
    assert make_batch_invariant(stack, torch.float32, cpu, row_range(stack, torch.float32, cpu))
    mlp = stack.blocks[-1].mlp
    inputs = torch.randn(300, stack.config.hidden_size, generator=torch.Generator().manual_seed(1))
    probe, others = inputs[:1], inputs[1:]
    with torch.inference_mode():
        alone = mlp(probe)[0]
        for rows in (2, 3, 10, 100, 300):
            for where in (0, rows // 2, rows - 1):
                assert torch.equal(mlp(torch.cat([others[:where], probe, others[where:rows - 1]]))[where], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_of_far_apart_lengths_in_one_forward_get_their_bits_alone(dtype):
    """One-token steps whose keys span one, two and four granules get the bits each gets alone when they share a
    forward: attended as one batch (core.packing.DecodeBatch), each over keys padded to the longest, where the
    start-up probe found that padding leaves a row's bits alone on this CPU, else one session at a time. In float32
    the batch kernel agrees with scaled_dot_product_attention over each step's own keys, whatever the probe found."""
    backend = backend_of(dtype)
    lengths = (5, 70, 200)

    def decode_steps(name: str) -> list:
        steps = []
        for seed, length in enumerate(lengths):
            session = backend.new_session(f"{name}{seed}", 0, 8, 1, 256)
            backend.step(session, random_hidden(1, length, seed, dtype), 0, 0, None, None)
            steps.append(lambda session=session, seed=seed, length=length: backend.prepare_step(
                session, random_hidden(1, 1, 50 + seed, dtype), length, 0, None, None))
        return steps

    alone = [backend.run_one(prepare()) for prepare in decode_steps("alone")]
    prepared = [prepare() for prepare in decode_steps("together")]
    assert pack([step.segment for step in prepared]).decode.members == [0, 1, 2]
    together = backend.run(prepared)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
    if dtype == torch.float32:
        backend.stack.batch_decode = True  # the batch kernel, one step at a time
        batched = [backend.run_one(prepare()) for prepare in decode_steps("batched")]
        backend.stack.batch_decode = False  # each step by scaled_dot_product_attention over its own keys
        apart = [backend.run_one(prepare()) for prepare in decode_steps("apart")]
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
                   for a, b in zip(batched, apart, strict=True))


def test_a_forward_waits_for_the_sessions_that_took_turns_and_they_merge():
    """Two sessions that took turns on a server holding their whole chains, their steps now arriving 20 ms apart,
    share one forward with --batch-wait-ms 500 (the batcher waits for the sessions of its last two forwards whose
    last turnaround brings them back in time); not with the default 0, nor when the late one took longer than the
    wait to come back before, nor for sessions that other servers compute too (they keep their turns: a
    pipeline)."""
    backend = backend_of(torch.float32)

    async def in_this_thread(fn, *args):
        return fn(*args)

    def forwards_of_the_last_steps(wait_s: float, b_came_back_after: float = 0.0,
                                   whole_chain: bool = True) -> int:
        sessions = {name: backend.new_session(f"{name}{wait_s}{b_came_back_after}{whole_chain}", 0, 8, 1, MAX_LENGTH)
                    for name in "ab"}
        batcher = StepBatcher(backend, in_this_thread, BatchLimits(8, 64, wait_s), lambda vectors, blocks: 0.5)

        async def step(name: str, position: int, delay: float) -> None:
            await asyncio.sleep(delay)
            hidden = random_hidden(1, 1, position, torch.float32)
            await batcher.compute(name, (0, 8), 1, 1, lambda: backend.prepare_step(sessions[name], hidden, position, 0,
                                                                                   None, None), None, whole_chain)

        async def run() -> int:
            for position in range(2):  # each alone, in turns
                await step("a", position, 0.0)
                await step("b", position, b_came_back_after * position)
            before = batcher.forwards
            await asyncio.gather(step("a", 2, 0.0), step("b", 2, 0.02))
            await batcher.close()
            return batcher.forwards - before

        return asyncio.run(run())

    assert forwards_of_the_last_steps(0.5) == 1
    assert forwards_of_the_last_steps(0.0) == 2
    assert forwards_of_the_last_steps(0.5, b_came_back_after=0.7) == 2
    assert forwards_of_the_last_steps(0.5, whole_chain=False) == 2


def test_a_forward_waits_for_the_first_step_of_a_session_just_opened():
    """Sessions opened together compute their prompts in one forward with --batch-wait-ms 500: the step of one that
    opened waits (up to the wait limit) for the first step of the other, which opened before that forward began; not
    with the default 0, nor for a session opened once the forward had begun without it."""
    backend = backend_of(torch.float32)

    async def in_this_thread(fn, *args):
        return fn(*args)

    def forwards_of_two_prompts(wait_s: float, b_opens_late: bool = False) -> int:
        sessions = {name: backend.new_session(f"{name}{wait_s}{b_opens_late}", 0, 8, 1, MAX_LENGTH) for name in "ab"}
        batcher = StepBatcher(backend, in_this_thread, BatchLimits(8, 64, wait_s), lambda vectors, blocks: 0.5)

        async def prompt(name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            hidden = random_hidden(1, 5, len(name), torch.float32)
            await batcher.compute(name, (0, 8), 1, 5, lambda: backend.prepare_step(sessions[name], hidden, 0, 0, None,
                                                                                   None), None, True)

        async def run() -> int:
            batcher.opened("a")
            if not b_opens_late:
                batcher.opened("b")
            first = asyncio.create_task(prompt("a", 0.0))
            await asyncio.sleep(0.01)
            if b_opens_late:  # a's forward waits for no one: it has run by now
                batcher.opened("b")
            await asyncio.gather(first, prompt("b", 0.0))
            await batcher.close()
            return batcher.forwards

        return asyncio.run(run())

    assert forwards_of_two_prompts(0.5) == 1
    assert forwards_of_two_prompts(0.0) == 2
    assert forwards_of_two_prompts(0.5, b_opens_late=True) == 2


def test_decode_steps_go_ahead_of_an_older_prompt_once():
    """A decode step waiting beside an older prompt computes first, in a forward of its own (an interactive session is
    not held behind a prompt); the prompt, passed over once, goes next, with a decode step that came meanwhile."""
    backend = backend_of(torch.float32)
    sessions = {name: backend.new_session(f"first-{name}", 0, 8, 1, MAX_LENGTH) for name in "pab"}
    for name in "ab":  # their prompts, so that their next steps decode
        backend.step(sessions[name], random_hidden(1, 3, ord(name), torch.float32), 0, 0, None, None)

    forwards = []  # (steps, vectors) of each forward
    late = []  # the task of b's step, which comes while the first forward computes

    async def computing_while_b_comes(fn, *args):
        if not late:
            late.append(asyncio.create_task(step("b", 1, 3)))
            await asyncio.sleep(0)  # b's step reaches the batcher
        return fn(*args)

    batcher = StepBatcher(backend, computing_while_b_comes, BatchLimits(8, 64, 0.0), lambda vectors, blocks: 0.5,
                          on_forward=lambda timing: forwards.append((timing.steps, timing.vectors)))

    async def step(name: str, tokens: int, position: int) -> None:
        hidden = random_hidden(1, tokens, position, torch.float32)
        await batcher.compute(name, (0, 8), 1, tokens, lambda: backend.prepare_step(sessions[name], hidden, position,
                                                                                     0, None, None), None, True)

    async def run() -> None:
        await asyncio.gather(step("p", 5, 0), step("a", 1, 3))
        await late[0]
        await batcher.close()

    asyncio.run(run())
    assert forwards == [(1, 1), (2, 6)]
