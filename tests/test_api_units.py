"""The API's pieces without a swarm: batching rules, per-row sampling, stop strings split across tokens."""

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from bloombee.api.generation import DONE, Delta, Finish, Job, RowSampler, RowText, left_pad
from bloombee.api.scheduler import fits
from bloombee.loading import resolve_model


def make_job(prompt_lengths: list[int], max_tokens: int, n: int = 1, stops: list[str] | None = None,
             loop: asyncio.AbstractEventLoop | None = None, temperature: float = 0.0) -> Job:
    return Job(prompts=[[5] * length for length in prompt_lengths], max_tokens=max_tokens, temperature=temperature, top_p=1.0,
               stops=stops or [], seed=None, n=n, loop=loop)


def test_jobs_share_a_session_only_within_rows_and_length_and_greedy_with_greedy():
    first = make_job([10], 90)  # needs 100 positions
    assert fits([first], make_job([8], 50), max_rows=8)  # padded: 10 + 90 = 100
    assert not fits([first], make_job([90], 10), max_rows=8)  # padded: 90 + 90 = 180 > 100
    assert not fits([first], make_job([12], 80), max_rows=8)  # padded: 12 + 90 = 102 > 100
    assert not fits([first], make_job([10], 90, n=8), max_rows=8)  # 9 rows
    assert not fits([first], make_job([8], 50, temperature=0.7), max_rows=8)  # greedy batches speculate
    assert [choice for choice, _ in make_job([3, 4], 5, n=2).rows] == [0, 1, 2, 3]


def test_left_pad_aligns_prompts_on_the_right():
    ids, mask = left_pad([[7, 8, 9], [4]], pad_id=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_row_sampler_keeps_greedy_rows_and_seeds_sampled_ones():
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def sampled(seed: int, top_p: float) -> torch.Tensor:
        settings = [(0.0, 1.0, None), (1.0, top_p, torch.Generator().manual_seed(seed)),
                    (0.7, 1.0, torch.Generator().manual_seed(seed))]
        return RowSampler(settings)(None, scores)

    out = sampled(3, 1.0)
    assert torch.equal(out[0], scores[0])
    assert torch.isfinite(out[1]).sum() == 1 and torch.isfinite(out[2]).sum() == 1
    assert torch.equal(out, sampled(3, 1.0))
    assert int(sampled(4, 1e-6)[1].argmax()) == int(scores[1].argmax())  # top_p this small leaves the top token only


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("bloombee-tiny"))


def run_row(tokenizer, text: str, stops: list[str], max_tokens: int = 100) -> list:
    """Feed `text`'s tokens one by one to a RowText; the events it emitted."""

    async def feed() -> list:
        job = make_job([1], max_tokens, stops=stops, loop=asyncio.get_running_loop())
        row = RowText(job, 0, tokenizer, eos_ids={tokenizer.eos_token_id})
        for token in tokenizer(text, add_special_tokens=False).input_ids:
            if not row.done:
                row.add(token)
        row.end()
        job.emit(DONE)
        events = []
        while (event := await job.events.get()) is not DONE:
            events.append(event)
        return events

    return asyncio.run(feed())


def test_text_before_a_stop_string_is_sent_and_the_stop_never(tokenizer):
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"
    events = run_row(tokenizer, text, stops=["else fib"])
    deltas = [event.text for event in events if isinstance(event, Delta)]
    assert "".join(deltas) == text[:text.index("else fib")]
    assert all("else" not in delta for delta in deltas)
    assert isinstance(events[-1], Finish) and events[-1].reason == "stop"


def test_without_a_stop_the_row_ends_at_its_token_budget(tokenizer):
    text = "import os\nimport sys\n"
    tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
    events = run_row(tokenizer, text, stops=[], max_tokens=tokens - 1)
    assert events[-1] == Finish(0, "length", tokens - 1)
    assert "".join(event.text for event in events if isinstance(event, Delta)) == \
        tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids[:tokens - 1])
