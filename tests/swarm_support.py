"""Helpers for tests that run a real local swarm (bootstrap peer + server processes on 127.0.0.1)."""

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, StoppingCriteria

from bloombee.client import AutoDistributedModel
from bloombee.loading import dht_prefix, load_block_stack
from bloombee.local_swarm import LocalSwarm
from bloombee.protocol import Message, unpack
from bloombee.protocol.streams import queue_stream
from conftest import make_tiny_model

NUM_BLOCKS = 8
POLL_PERIOD = 0.2  # seconds between checks of a condition awaited with poll()
STREAM_TIMEOUT = 30.0  # seconds any one reply on a Stream may take


def save_tiny_llama(folder: Path, num_layers: int = NUM_BLOCKS) -> Path:
    """An 8-block GQA Llama with random weights, saved like a hub checkpoint."""
    make_tiny_model("llama-gqa", num_layers=num_layers, seed=1).save_pretrained(folder)
    return folder


def weight_bytes(folder: Path, start: int, end: int) -> int:
    """Bytes of blocks [start, end) of the checkpoint in float32, as the tests' servers load them."""
    return sum(p.numel() * p.element_size() for p in load_block_stack(folder, start, end).parameters())


def reference(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def start_swarm(folder: Path | str, log_dir: Path, cache_dir: Path, num_blocks: int = NUM_BLOCKS) -> LocalSwarm:
    swarm = LocalSwarm(str(folder), num_blocks, dht_prefix(folder), log_dir=str(log_dir),
                       env={"BLOOMBEE_CACHE": str(cache_dir)})
    swarm.start_bootstrap()
    return swarm


@contextlib.contextmanager
def serving(folder: Path | str, tmp_path_factory, servers: dict[str, str], *args: str) -> Iterator[LocalSwarm]:
    """A swarm with a server per name -> blocks of `servers`, each started with `args`; stopped on exit."""
    swarm = start_swarm(folder, tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"))
    try:
        for name, blocks in servers.items():
            swarm.add_server("--blocks", blocks, *args, name=name, wait=False)
        swarm.wait_online(list(servers))
        yield swarm
    finally:
        swarm.stop()


class KillServerAt(StoppingCriteria):
    """After `after` generated tokens past a `prompt_length`-token prompt, SIGKILL the server serving span
    `span_index` of the model's active session."""

    def __init__(self, swarm: LocalSwarm, model, span_index: int, after: int, prompt_length: int):
        self.swarm, self.model, self.span_index, self.after = swarm, model, span_index, after
        self.prompt_length, self.killed = prompt_length, None

    def __call__(self, input_ids, scores, **kwargs):
        if self.killed is None and input_ids.shape[1] - self.prompt_length >= self.after:
            self.killed = self.model._session.spans[self.span_index].record.public_name
            self.swarm.kill(self.killed, signal.SIGKILL)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def client(swarm: LocalSwarm, **kwargs) -> AutoDistributedModel:
    return AutoDistributedModel.from_pretrained(swarm.model, initial_peers=swarm.initial_peers, dtype=torch.float32, **kwargs)


def generate_at_once(model, prompts: list[torch.Tensor], new_tokens: int) -> tuple[list, list[Exception]]:
    """Each prompt's greedy output, generated in a thread of its own, all released at once; and the errors raised."""
    outputs, errors = [None] * len(prompts), []
    barrier = threading.Barrier(len(prompts))

    def run(index: int) -> None:
        barrier.wait()
        try:
            outputs[index] = model.generate(prompts[index], max_new_tokens=new_tokens, do_sample=False)
        except Exception as error:  # returned to the test, which asserts there are none
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return outputs, errors


def poll(condition, limit: float, what: str) -> float:
    """The moment (time.monotonic()) `condition()` held; AssertionError after `limit` seconds."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < limit, f"{what} not within {limit:g} s"
        time.sleep(POLL_PERIOD)
    return time.monotonic()


def capture_sessions(model) -> list:
    """Wrap model.remote.inference_session so that the sessions speculative generation opens can be looked at."""
    opened, original = [], model.remote.inference_session

    def capturing(*args, **kwargs):
        opened.append(original(*args, **kwargs))
        return opened[-1]

    model.remote.inference_session = capturing
    return opened


class KillAfter:
    """A streamer: once `after` new tokens have come, SIGKILL the server of span `span_index` of the last captured
    session (`capture_sessions`)."""

    def __init__(self, swarm: LocalSwarm, sessions: list, after: int, span_index: int):
        self.swarm, self.sessions, self.after, self.span_index = swarm, sessions, after, span_index
        self.tokens, self.victim, self.killed_at = -1, None, None  # the first put() is the prompt

    def put(self, tokens: torch.Tensor) -> None:
        self.tokens += 1 if self.tokens < 0 else tokens.numel()
        if self.victim is None and self.tokens >= self.after:
            self.victim = self.sessions[-1].spans[self.span_index].record.public_name
            self.swarm.kill(self.victim)
            self.killed_at = self.tokens

    def end(self) -> None:
        pass


class Stream:
    """One streaming RPC call: requests go in through a queue, replies come out within STREAM_TIMEOUT seconds each."""

    def __init__(self, method):
        self.method, self.outbox, self.replies = method, asyncio.Queue(), None

    async def start(self, first=None) -> "Stream":
        if first is not None:
            self.outbox.put_nowait(first)
        self.replies = aiter(await asyncio.wait_for(self.method(queue_stream(self.outbox)), STREAM_TIMEOUT))
        return self

    def send(self, request) -> None:
        self.outbox.put_nowait(request)

    async def reply(self) -> tuple[Message, dict]:
        try:
            return unpack(await asyncio.wait_for(anext(self.replies), STREAM_TIMEOUT))
        except asyncio.TimeoutError:
            raise AssertionError(f"no reply on a {self.method.__name__} stream within {STREAM_TIMEOUT:g} s") from None

    async def close(self) -> list[Message]:
        """End the stream; what came back before it ended."""
        self.outbox.put_nowait(None)
        return await asyncio.wait_for(self._rest(), STREAM_TIMEOUT)

    async def _rest(self) -> list[Message]:
        rest = []
        with contextlib.suppress(ConnectionError):  # the server ended the stream first: our end-of-stream is lost
            async for response in self.replies:
                rest.append(unpack(response)[0])
        return rest
