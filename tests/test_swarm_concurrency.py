"""One model object, several threads (or asyncio tasks) generating at once: each gets its own session and its own tokens."""

import asyncio
import threading

import pytest
import torch
from swarm_support import client, generate_at_once, save_tiny_llama, start_swarm

PROMPTS = [torch.tensor([[3, 14, 15, 92, 65]]), torch.tensor([[27, 18, 28]]), torch.tensor([[1, 41, 42, 13, 56, 23, 9]]),
           torch.tensor([[100, 7]])]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model") / "threads-llama")
    swarm = start_swarm(folder, tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"))
    try:
        for name, blocks in (("a", "0:4"), ("b", "4:8")):
            swarm.add_server("--blocks", blocks, "--dtype", "float32", "--no-profile", name=name, wait=False)
        swarm.wait_online(["a", "b"])
        yield swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def model(swarm):
    return client(swarm, request_timeout=30.0)


@pytest.fixture(scope="module")
def expected(model):
    """Each prompt's greedy output, generated one at a time."""
    return [model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False) for prompt in PROMPTS]


def test_four_threads_generate_at_once_on_one_model(model, expected):
    outputs, errors = generate_at_once(model, PROMPTS, NEW_TOKENS)
    assert errors == []
    for output, want in zip(outputs, expected):
        assert torch.equal(output, want)


def test_threads_keep_their_own_sessions_across_generate_calls(model, expected):
    """Inside `inference_session`, each thread's second call continues its own sequence, not another thread's."""
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def run(index: int) -> None:
        try:
            with model.inference_session(max_length=64):
                barrier.wait()
                first = model.generate(PROMPTS[index], max_new_tokens=NEW_TOKENS // 2, do_sample=False)
                second = model.generate(torch.empty(1, 0, dtype=torch.long), max_new_tokens=NEW_TOKENS // 2, do_sample=False)
            results[index] = torch.cat([first[:, :-1], second], dim=1)
        except Exception as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == []
    for index in range(2):
        assert torch.equal(results[index], expected[index])


def test_asyncio_tasks_generate_at_once(model, expected):
    async def all_prompts():
        return await asyncio.gather(*(asyncio.to_thread(model.generate, prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
                                      for prompt in PROMPTS))

    for output, want in zip(asyncio.run(all_prompts()), expected):
        assert torch.equal(output, want)
