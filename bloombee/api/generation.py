"""Running a batch of API requests as one `generate()` call: per-row sampling, stop strings, streaming, cancel."""

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, StoppingCriteria

from bloombee.api.errors import APIError, invalid, swarm_unavailable
from bloombee.client import MissingBlocksError, RequestRejected
from bloombee.speculative.api import speculative_generate

logger = logging.getLogger(__name__)

_job_ids = itertools.count(1)


@dataclass(frozen=True)
class Delta:
    choice: int
    text: str


@dataclass(frozen=True)
class Finish:
    choice: int
    reason: str  # "stop" (eos or a stop string) or "length"
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: APIError


DONE = object()  # the last event of every job


@dataclass
class Job:
    """One API request: its prompts' rows (n choices each), sampling settings, and the queue its events go to."""

    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    top_p: float
    stops: list[str]
    seed: int | None
    n: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = field(default_factory=lambda: next(_job_ids))

    @property
    def rows(self) -> list[tuple[int, list[int]]]:
        """(choice index, prompt ids) per row: prompt i's choices are i * n .. i * n + n - 1."""
        return [(index * self.n + copy, prompt) for index, prompt in enumerate(self.prompts) for copy in range(self.n)]

    @property
    def length(self) -> int:
        """Positions one row of this job needs: its longest prompt plus the new tokens."""
        return max(len(prompt) for prompt in self.prompts) + self.max_tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    def emit(self, event) -> None:
        """Hand an event to the request's coroutine (thread-safe)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def generator(self, choice: int) -> torch.Generator | None:
        """The random source of one sampled choice: seeded per choice when the request has a seed."""
        if self.temperature == 0:
            return None
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed + choice)
        return generator


class RowSampler(LogitsProcessor):
    """Samples each sampled row with its own temperature, top-p and generator; greedy rows keep their logits.

    The sampled token is left as the only finite score, so generate(do_sample=False) takes it.
    """

    def __init__(self, settings: list[tuple[float, float, torch.Generator | None]]):
        self.settings = settings

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, (temperature, top_p, generator) in enumerate(self.settings):
            if temperature == 0:
                continue
            token = sample(scores[row], temperature, top_p, generator)
            scores[row] = float("-inf")
            scores[row, token] = 0.0
        return scores


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from softmax(logits / temperature), restricted to the smallest set of mass >= top_p."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= top_p
        probs = probs.clone()
        probs[order[outside]] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator))


class RowText:
    """One row's generated text: decodes incrementally, holds back what may be the start of a stop string."""

    def __init__(self, job: Job, choice: int, tokenizer, eos_ids: set[int]):
        self.job, self.choice, self.tokenizer, self.eos_ids = job, choice, tokenizer, eos_ids
        self.ids: list[int] = []
        self.sent = 0
        self.done = False

    def add(self, token: int) -> None:
        if self.job.cancelled.is_set():
            self.done = True
            return
        if token in self.eos_ids:
            self._finish("stop", len(self.ids) + 1)
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        stop_at = self._stop_position(text)
        if stop_at is not None:
            self._send(text[:stop_at])
            self._finish("stop", len(self.ids))
        elif len(self.ids) >= self.job.max_tokens:
            self._send(text)
            self._finish("length", len(self.ids))
        else:
            self._send(text[:len(text) - self._held_back(text)])

    def end(self) -> None:
        """Finish a row that generate() left open (it runs to the largest budget of its rows, so normally none)."""
        if not self.done:
            self._send(self.tokenizer.decode(self.ids, skip_special_tokens=True))
            self._finish("length", len(self.ids))

    def _stop_position(self, text: str) -> int | None:
        longest = max((len(stop) for stop in self.job.stops), default=0)
        begin = max(0, self.sent - longest)
        found = [index for stop in self.job.stops if (index := text.find(stop, begin)) >= 0]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """Characters at the end that a stop string or an unfinished multi-byte character may still claim."""
        if text.endswith("\ufffd"):
            return len(text) - self.sent
        for size in range(max((len(stop) for stop in self.job.stops), default=1) - 1, 0, -1):
            if any(stop.startswith(text[-size:]) for stop in self.job.stops) and len(text) >= size:
                return size
        return 0

    def _send(self, text: str) -> None:
        if len(text) > self.sent:
            self.job.emit(Delta(self.choice, text[self.sent:]))
            self.sent = len(text)

    def _finish(self, reason: str, tokens: int) -> None:
        self.done = True
        self.job.emit(Finish(self.choice, reason, tokens))


class RowTracker(StoppingCriteria):
    """Feeds each row its new tokens and says which rows are done: called by transformers' generate() after each
    step, and by speculative generation (`feed`) after each round."""

    def __init__(self, rows: list[RowText]):
        self.rows = rows

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.tensor([self.feed(index, [token]) for index, token in enumerate(input_ids[:, -1].tolist())],
                            dtype=torch.bool)

    def feed(self, index: int, tokens: list[int]) -> bool:
        """Give row `index` its new tokens; whether it is done (finished, or its request cancelled)."""
        row = self.rows[index]
        for token in tokens:
            if not row.done:
                row.add(token)
        row.done = row.done or row.job.cancelled.is_set()
        return row.done


def client_error(error: Exception) -> APIError:
    """The API error for a failure of the swarm client."""
    if isinstance(error, RequestRejected):
        return invalid(str(error), None, "rejected_by_server")
    if isinstance(error, MissingBlocksError):
        return swarm_unavailable(str(error))
    return swarm_unavailable(f"generation through the swarm failed: {error}")


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and attention mask of prompts padded on the left to the longest."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def run_batch(model, tokenizer, jobs: list[Job], pad_id: int, eos_ids: set[int]) -> bool:
    """Generate every row of `jobs` in one inference session; each job gets its events, then DONE. Whether the
    batch was generated speculatively."""
    try:
        return generate_rows(model, tokenizer, jobs, pad_id, eos_ids)
    except Exception as error:  # every failure reaches the requests' clients as an API error
        logger.warning("Generation for requests %s failed: %s", [job.id for job in jobs], error,
                       exc_info=logger.isEnabledFor(logging.DEBUG))
        for job in jobs:
            job.emit(Failed(client_error(error)))
        return False
    finally:
        for job in jobs:
            job.emit(DONE)


def generate_rows(model, tokenizer, jobs: list[Job], pad_id: int, eos_ids: set[int]) -> bool:
    """One generate() call over the rows of all `jobs`, left-padded, each row sampled and stopped on its own.

    A greedy batch is generated as `model.generate()` generates by default: speculatively with the client's
    draft model when it has one, so a greedy request gives the same tokens through both. Whether it was.
    """
    rows, prompts, settings = [], [], []
    for job in jobs:
        for choice, prompt in job.rows:
            rows.append(RowText(job, choice, tokenizer, eos_ids))
            prompts.append(prompt)
            settings.append((job.temperature, job.top_p, job.generator(choice)))
    ids, mask = left_pad(prompts, pad_id)
    draft = model.settings_draft() if all(job.temperature == 0 for job in jobs) else None
    logger.info("Generating %d rows of %d requests in one session%s", len(rows), len(jobs),
                ", speculatively" if draft is not None else "")
    new_tokens = max(job.max_tokens for job in jobs)
    if draft is not None:
        speculative_generate(model, ids, draft, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=pad_id, on_tokens=RowTracker(rows).feed)
    else:
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, draft_model="none",
                       logits_processor=[RowSampler(settings)], stopping_criteria=[RowTracker(rows)],
                       pad_token_id=pad_id)
    for row in rows:
        row.end()
    return draft is not None
