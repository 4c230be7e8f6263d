"""Prometheus metrics of a real server and a real `bloombee-api` (--metrics-port), scraped over HTTP while and after
they serve: sessions, rows and seconds per forward, bytes per hop, cache bytes, refusals; requests, latency, tokens."""

import urllib.request

import openai
import pytest
import torch
from api_support import MODEL, ApiProcess, free_port, start_tiny_swarm
from prometheus_client.parser import text_string_to_metric_families

from bloombee.client import AutoDistributedModel
from swarm_support import poll

SERVER_MAX_LENGTH = 256
NEW_TOKENS, ROWS, PROMPT = 6, 2, 12


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture(scope="module")
def metrics_port():
    return free_port()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, metrics_port):
    swarm = start_tiny_swarm(tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"), {"whole": "0:8"},
                             "--max-length", str(SERVER_MAX_LENGTH), "--metrics-port", str(metrics_port))
    yield swarm
    swarm.stop()


def test_a_server_counts_its_sessions_forwards_bytes_and_refusals(swarm, metrics_port):
    before = scrape(metrics_port)
    assert before[("bloombee_server_sessions_open", ())] == 0
    prompt = torch.randint(5, 4000, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    with AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers) as model:
        with model.inference_session(max_length=64, batch_size=ROWS):
            model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            during = scrape(metrics_port)
        with pytest.raises(Exception, match=f"over this server's limit of {SERVER_MAX_LENGTH}"):
            with model.inference_session(max_length=SERVER_MAX_LENGTH + 1):
                model.generate(prompt[:1], max_new_tokens=1, do_sample=False)
    assert during[("bloombee_server_sessions_open", ())] == 1
    assert during[("bloombee_server_cache_bytes", (("memory", "device"),))] > 0
    poll(lambda: scrape(metrics_port)[("bloombee_server_sessions_open", ())] == 0, 30, "the session closed")
    after = scrape(metrics_port)
    assert after[("bloombee_server_cache_bytes", (("memory", "device"),))] == 0
    steps = after[("bloombee_server_rows_per_forward_count", ())]
    assert steps == NEW_TOKENS  # the prompt, then one step per new token but the last
    assert after[("bloombee_server_rows_per_forward_sum", ())] == ROWS * (PROMPT + NEW_TOKENS - 1)  # rows x positions
    assert after[("bloombee_server_steps_per_forward_sum", ())] == steps  # one session: one step per forward
    assert after[("bloombee_server_step_seconds_count", ())] == steps
    assert after[("bloombee_server_step_seconds_sum", ())] > 0
    hidden_bytes = ROWS * 256 * 2  # a decode step's hidden states in bfloat16
    assert after[("bloombee_server_hop_bytes_total", (("direction", "in"),))] >= steps * hidden_bytes
    assert after[("bloombee_server_hop_bytes_total", (("direction", "out"),))] >= steps * hidden_bytes
    assert after[("bloombee_server_refusals_total", (("reason", "refused"),))] >= 1


def test_the_api_counts_requests_latency_and_tokens(swarm, tmp_path):
    port = free_port()
    api = ApiProcess(swarm, tmp_path / "api.log", "--metrics-port", str(port))
    try:
        client = openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answers = [client.completions.create(model=MODEL, prompt=text, max_tokens=5, temperature=0)
                   for text in ("def f(x):", "import os")]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="another-model", prompt="x", max_tokens=1)
        figures = scrape(port)
    finally:
        api.stop()
    path = "/v1/completions"
    assert figures[("bloombee_api_requests_total", (("path", path), ("status", "200")))] == 2
    assert figures[("bloombee_api_requests_total", (("path", path), ("status", "404")))] == 1
    assert figures[("bloombee_api_request_seconds_count", (("path", path),))] == 3
    assert figures[("bloombee_api_completion_tokens_total", ())] == sum(a.usage.completion_tokens for a in answers)
    assert figures[("bloombee_api_requests_queued", ())] == 0 and figures[("bloombee_api_sessions_open", ())] == 0
