"""Many sessions on one swarm (bloombee-tiny in bfloat16, batch-invariant servers and client): their steps share
forwards, and each session's outputs are bit for bit those of its solo run, whether the sessions are threads of one
client or client processes, beside a client killed or idle past the session timeout mid-generation; a server
batching several sessions is killed and each of them is replayed onto the other exactly, a speculative round too."""

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from benchmarks.invariance_bench import prompts
from bloombee.client import AutoDistributedModel
from bloombee.loading import resolve_model
from bloombee.speculative.tree import PackedTrees, TokenTree
from swarm_support import poll, serving

MODEL = "bloombee-tiny"
PROMPT, NEW_TOKENS = 16, 24
SESSION_TIMEOUT = 10  # seconds an idle session keeps its cache on these servers
SEEDS = range(6)
CLIENT_SCRIPT = Path(__file__).with_name("batching_client.py")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with serving(MODEL, tmp_path_factory, {"first": "0:8", "second": "0:8"}, "--batch-invariant", "on",
                 "--session-timeout", str(SESSION_TIMEOUT)) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def model(swarm):
    with AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers) as model:
        yield model


@torch.inference_mode()
def run_session(model, seed: int, on_token=lambda session, index: None) -> dict:
    """The session tests/batching_client.py runs, in this process: its tokens and a digest of its last outputs."""
    prompt = torch.randint(3, 4000, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    with model.remote.inference_session(max_length=PROMPT + NEW_TOKENS) as session:
        hidden = session.step(model.head.embed(prompt))
        tokens = [int(model.head.logits(hidden)[0, -1].argmax())]
        for index in range(NEW_TOKENS - 1):
            on_token(session, index)
            hidden = session.step(model.head.embed(torch.tensor([[tokens[-1]]])))
            tokens.append(int(model.head.logits(hidden)[0, -1].argmax()))
    return {"tokens": tokens, "hidden": hashlib.sha256(hidden.float().numpy().tobytes()).hexdigest()}


@pytest.fixture(scope="module")
def solo(model) -> dict[int, dict]:
    return {seed: run_session(model, seed) for seed in SEEDS}


def in_threads(model, seeds, on_token=lambda seed, session, index: None) -> dict[int, dict]:
    results: dict[int, dict] = {}

    def run(seed: int) -> None:
        results[seed] = run_session(model, seed, lambda session, index: on_token(seed, session, index))

    threads = [threading.Thread(target=run, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def forwards(model) -> tuple[int, int, float]:
    """(forwards, steps they computed, their seconds) of all servers."""
    infos = [model.remote.server_info(peer)["forwards"] for peer in model.remote.manager.usable_servers()]
    return tuple(sum(info[key] for info in infos) for key in ("count", "steps", "seconds"))


def test_sessions_in_threads_share_forwards_and_get_their_solo_outputs_bit_for_bit(model, solo):
    before = forwards(model)
    assert in_threads(model, SEEDS) == solo
    after = forwards(model)
    assert after[1] - before[1] == len(SEEDS) * NEW_TOKENS
    assert after[0] - before[0] < after[1] - before[1]  # some forwards computed several sessions' steps
    assert after[2] > before[2]


def client_process(swarm, seed: int, pause_at: int = -1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CLIENT_SCRIPT), MODEL, str(seed), str(NEW_TOKENS), str(pause_at),
                             *swarm.initial_peers], stdout=subprocess.PIPE, text=True)


def test_client_processes_get_their_solo_outputs_beside_one_killed_mid_generation(swarm, model, solo):
    doomed = client_process(swarm, seed=5, pause_at=8)
    others = {seed: client_process(swarm, seed) for seed in (0, 1, 2)}
    assert doomed.stdout.readline().strip() == "paused"
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    for seed, process in others.items():
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0 and json.loads(out.strip().splitlines()[-1]) == solo[seed]
    peers = list(model.remote.manager.usable_servers())
    poll(lambda: all(model.remote.server_info(peer)["open_sessions"] == 0 for peer in peers), 60,
         "the killed client's session closed and gave its cache back")


def test_a_session_timing_out_beside_others_gives_its_cache_back_and_disturbs_none(swarm, model, solo):
    idle = client_process(swarm, seed=5, pause_at=8)
    try:
        assert idle.stdout.readline().strip() == "paused"
        peers, rounds = list(model.remote.manager.usable_servers()), 0
        deadline = time.monotonic() + SESSION_TIMEOUT + 60
        # the idle client's session stays open until the servers' timeout ends it
        while any(model.remote.server_info(peer)["open_sessions"] for peer in peers):
            assert time.monotonic() < deadline, "the idle client's session did not expire"
            assert in_threads(model, (0, 1)) == {seed: solo[seed] for seed in (0, 1)}
            rounds += 1
        assert rounds > 1 and idle.poll() is None  # sessions ran beside it; its client is still there
    finally:
        idle.kill()
        idle.wait()


def test_a_server_batching_several_sessions_is_killed_and_each_is_replayed_exactly(swarm, model, solo):
    killed: list[str] = []

    def kill_at_token_ten(seed: int, session, index: int) -> None:
        if seed == 0 and index == 10 and not killed:
            killed.append(session.spans[0].record.public_name)
            swarm.kill(killed[0], signal.SIGKILL)

    results = in_threads(model, SEEDS, kill_at_token_ten)
    assert killed and {seed: result["tokens"] for seed, result in results.items()} == \
        {seed: result["tokens"] for seed, result in solo.items()}


def test_speculative_generation_gives_plain_decodings_tokens_in_bfloat16(swarm):
    """The prompts of benchmarks/invariance_bench.py, where speculation without the mode departs from plain decoding
    at new tokens 9 and 27 (near-ties of bfloat16 logits)."""
    inputs = prompts(AutoTokenizer.from_pretrained(resolve_model(MODEL)))
    with AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers, speculation="on",
                                              batch_invariant="on") as model:
        for prompt in inputs:
            plain = model.generate(prompt, max_new_tokens=40, do_sample=False, draft_model="none")
            assert torch.equal(model.generate(prompt, max_new_tokens=40, do_sample=False), plain)


@torch.inference_mode()
def prompt_tree_then_token(model, on_commit=lambda session: None) -> torch.Tensor:
    """A prompt, a tree step whose root, child and grandchild are accepted, then one token: that step's output."""
    generator = torch.Generator().manual_seed(5)
    prompt, token = (model.head.embed(torch.randint(3, 4000, shape, generator=generator))
                     for shape in ((1, 12), (1, 1)))
    tree = PackedTrees.of([TokenTree(torch.randint(3, 4000, (7,), generator=generator),
                                       torch.tensor([-1, 0, 0, 1, 1, 2, 2]))])
    with model.remote.inference_session(max_length=32) as session:
        session.step(prompt)
        session.tree_step(model.head.embed(tree.tokens), tree)
        session.commit_tree([torch.tensor([0, 1, 3])])
        on_commit(session)
        return session.step(token)


def test_a_tree_round_is_replayed_onto_a_replacement_bit_for_bit(swarm, model):
    """Replays repeat a round's accepted tokens one at a time, as servers in `--batch-invariant on` computed them. In
    float32 (here: two float32 servers replace the others) one step of the three tokens would round otherwise."""
    for server in swarm.servers:
        if server.process.poll() is None:
            swarm.kill(server.name, signal.SIGKILL)
    for name in ("third", "fourth"):
        swarm.add_server("--blocks", "0:8", "--batch-invariant", "on", "--dtype", "float32", name=name, wait=False)
    swarm.wait_online(["third", "fourth"])
    model.remote.manager.update(force=True)
    undisturbed = prompt_tree_then_token(model)
    killed = []

    def kill_its_server(session) -> None:
        killed.append(session.spans[0].record.public_name)
        swarm.kill(killed[0], signal.SIGKILL)

    assert torch.equal(prompt_tree_then_token(model, kill_its_server), undisturbed) and killed
