"""`bloombee-api` against a real local swarm, through the official `openai` client: the same tokens as generate(),
streaming, concurrent requests sharing a session, and OpenAI-style errors."""

import http.client
import json
import threading
import time

import openai
import pytest
import torch
from api_support import MODEL, ApiProcess, start_tiny_swarm
from transformers import AutoTokenizer

from bloombee.api.chat_template import DEFAULT_TEMPLATE_STOPS, ChatFormatter
from bloombee.api.schemas import ChatMessage
from bloombee.client import AutoDistributedModel
from bloombee.loading import resolve_model

SERVER_MAX_LENGTH = 512
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = start_tiny_swarm(tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"),
                             {"s0": "0:4", "s1": "4:8"}, "--max-length", str(SERVER_MAX_LENGTH))
    yield swarm
    swarm.stop()


@pytest.fixture(scope="module")
def api(swarm, tmp_path_factory):
    process = ApiProcess(swarm, tmp_path_factory.mktemp("api") / "api.log", "--batch-window-ms", "300")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(MODEL))


@pytest.fixture(scope="module")
def model(swarm):
    return AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers)


def greedy_text(model, tokenizer, ids: list[int], new_tokens: int) -> tuple[str, int]:
    """What generate() continues `ids` with, and how many tokens that took (the eos counted)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    used = new[:new.index(eos) + 1] if eos in new else new
    return tokenizer.decode(used, skip_special_tokens=True), len(used)


def test_models_lists_the_served_model(client):
    assert [entry.id for entry in client.models.list().data] == [MODEL]


def test_greedy_completion_equals_generate(client, api, model, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    expected, used = greedy_text(model, tokenizer, ids, 24)
    speculated_before = api.status()["api"]["speculative_batches"]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert api.status()["api"]["speculative_batches"] == speculated_before + 1  # with generate()'s default draft
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == ("length" if used == 24 else "stop")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), used)
    assert response.usage.total_tokens == len(ids) + used


def test_token_id_prompts_work_and_out_of_vocabulary_ids_are_refused(client, model, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    expected, _ = greedy_text(model, tokenizer, ids, 8)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0).choices[0].text == expected
    error = error_of(lambda: client.completions.create(model=MODEL, prompt=[5, 99999], max_tokens=2))
    assert error.status_code == 400 and error.body["param"] == "prompt" and "[0, 4096)" in error.body["message"]


def test_streamed_completion_equals_the_whole_one(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    pieces = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert len(pieces) > 2 and "".join(pieces) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_uses_the_default_template_and_equals_generate(client, model, tokenizer):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}]
    ids = ChatFormatter(tokenizer).encode([ChatMessage(**message) for message in messages])
    text, _ = greedy_text(model, tokenizer, ids, 24)
    cut = min([text.index(stop) for stop in DEFAULT_TEMPLATE_STOPS if stop in text], default=len(text))
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == text[:cut]
    assert response.usage.prompt_tokens == len(ids)


def test_streamed_chat_sends_the_role_then_the_content(client):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_two_concurrent_streams_share_one_session(client, api):
    prompts = ["class Stack:", "import sys\nfor line in"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text for p in prompts]
    largest_before = api.status()["api"]["largest_batch"]
    texts, errors, barrier = [None, None], [], threading.Barrier(2)

    def stream(index: int) -> None:
        barrier.wait()
        try:
            chunks = client.completions.create(model=MODEL, prompt=prompts[index], max_tokens=16, temperature=0, stream=True)
            texts[index] = "".join(chunk.choices[0].text for chunk in chunks)
        except Exception as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == [] and texts == alone
    assert largest_before == 1 and api.status()["api"]["largest_batch"] == 2


def test_seed_makes_sampling_reproducible_and_choices_differ(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, seed=7, n=2)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text
    assert [c.index for c in first.choices] == [0, 1]


def test_stop_string_ends_the_text_before_it(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = whole[6:9]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert response.choices[0].text == whole[:whole.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    body = caught.value.body
    assert set(body) == {"message", "type", "param", "code"}, body  # the openai client unwraps {"error": {...}}
    return caught.value


def test_unknown_model_is_404(client):
    error = error_of(lambda: client.completions.create(model="bloombee-tinyy", prompt="x", max_tokens=2))
    assert error.status_code == 404 and error.body["code"] == "model_not_found" and MODEL in error.body["message"]


def test_context_length_is_checked_before_the_swarm(client):
    error = error_of(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1020))
    assert error.status_code == 400 and error.body["code"] == "context_length_exceeded"
    assert "maximum context length is 1024 tokens" in error.body["message"]


def test_max_tokens_over_the_api_limit(client):
    error = error_of(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5000))
    assert error.status_code == 400 and error.body["param"] == "max_tokens" and "limit of 2048" in error.body["message"]


def test_bad_field_names_the_field(client):
    error = error_of(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=3.5))
    assert error.status_code == 400 and error.body["param"] == "temperature"


def test_too_many_choices(client):
    error = error_of(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=9))
    assert error.status_code == 400 and error.body["param"] == "n"


def test_over_a_servers_max_length_names_the_server(client):
    error = error_of(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=SERVER_MAX_LENGTH))
    assert error.status_code == 400 and error.body["code"] == "rejected_by_server"
    assert f"over this server's limit of {SERVER_MAX_LENGTH}" in error.body["message"]
    assert "server s0" in error.body["message"] or "server s1" in error.body["message"]


def open_sessions(model) -> int:
    model.remote.manager.update()
    servers = model.remote.manager.usable_servers()
    assert len(servers) == 2
    return sum(model.remote.server_info(peer_id)["open_sessions"] for peer_id in servers)


def test_speculative_generate_runs_up_to_a_servers_max_length(model, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=SERVER_MAX_LENGTH - len(ids), do_sample=False,
                         speculation="on", eos_token_id=None)
    assert out.shape == (1, SERVER_MAX_LENGTH)  # trees shrank to the room the servers' limit leaves
    assert model.last_speculation.tree_rounds > 0


def test_client_disconnecting_mid_stream_frees_its_session(api, model):
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 490, "temperature": 0, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    first = [response.readline() for _ in range(6)]
    assert any(line.startswith(b"data: {") for line in first)
    assert open_sessions(model) == 2  # one session through both servers
    connection.close()
    deadline = time.monotonic() + 60
    while (open_sessions(model) or api.status()["api"]["active_sessions"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert open_sessions(model) == 0 and api.status()["api"]["active_sessions"] == 0


def test_status_json_shows_the_chain(api):
    status = api.status()["models"][0]
    assert status["full_chain"] and status["uncovered"] == []
    assert {(s["public_name"], s["start_block"], s["end_block"]) for s in status["servers"]} == {("s0", 0, 4), ("s1", 4, 8)}


def test_a_full_queue_answers_429(swarm, tmp_path):
    busy = ApiProcess(swarm, tmp_path / "busy.log", "--max-sessions", "1", "--max-queue", "1", "--batch-window-ms", "0")
    try:
        client = openai.OpenAI(base_url=busy.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        long_stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=490, temperature=0, stream=True)
        next(iter(long_stream))  # the first request holds the only session
        waiting = threading.Thread(target=lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2))
        waiting.start()
        deadline = time.monotonic() + 30
        while busy.status()["api"]["waiting_requests"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        error = error_of(lambda: client.completions.create(model=MODEL, prompt="y", max_tokens=2))
        assert error.status_code == 429 and error.body["code"] == "queue_full"
        long_stream.close()
        waiting.join(timeout=120)
        assert not waiting.is_alive()
    finally:
        busy.stop()
