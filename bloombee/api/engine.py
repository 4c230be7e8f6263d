"""The API's side of the swarm: one distributed model, its tokenizer, request checks and the scheduler."""

import asyncio
import logging
from dataclasses import dataclass

from bloombee.api.chat_template import ChatFormatter
from bloombee.api.errors import APIError, invalid
from bloombee.api.generation import Job, run_batch
from bloombee.api.metrics import ApiMetrics
from bloombee.api.scheduler import Scheduler
from bloombee.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from bloombee.client.swarm_status import ModelStatus, model_status
from bloombee.settings import ApiSettings

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A checked request: its job, and whether to stream it."""

    job: Job
    stream: bool
    include_usage: bool


class Engine:
    """Checks requests against the model's and the API's limits, queues them, and runs their batches."""

    def __init__(self, model, tokenizer, name: str, settings: ApiSettings):
        self.model, self.tokenizer, self.name, self.settings = model, tokenizer, name, settings
        self.formatter = ChatFormatter(tokenizer)
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids), 0)
        self.scheduler = Scheduler(self._run, settings.max_sessions, settings.max_queue, settings.max_batch_rows,
                                   settings.batch_window_ms / 1000)
        self.metrics = ApiMetrics(self.scheduler)
        self.speculative_batches = 0  # batches generated with the client's draft model, as generate() does

    def _run(self, jobs: list[Job]) -> None:
        if run_batch(self.model, self.tokenizer, jobs, self.pad_id, self.eos_ids):
            self.speculative_batches += 1

    def stats(self) -> dict:
        """The scheduler's figures and how many batches were generated speculatively."""
        return {**self.scheduler.stats(), "speculative_batches": self.speculative_batches}

    def check_model(self, requested: str) -> None:
        if requested != self.name:
            raise APIError(404, f"model {requested!r} is not served here; this server serves {self.name!r} (see GET /v1/models)",
                           "invalid_request_error", "model", "model_not_found")

    def completion(self, request: CompletionRequest) -> Prepared:
        prompts = [prompt if isinstance(prompt, list) else self.tokenizer(prompt).input_ids for prompt in request.prompts()]
        return self._prepare(request, prompts, request.stops, "prompt")

    def chat(self, request: ChatCompletionRequest) -> Prepared:
        prompt = self.formatter.encode(request.messages)
        stops = request.stops + [stop for stop in self.formatter.implied_stops if stop not in request.stops]
        return self._prepare(request, [prompt], stops, "messages")

    def _prepare(self, request: SamplingFields, prompts: list[list[int]], stops: list[str], prompt_param: str) -> Prepared:
        self.check_model(request.model)
        longest = max(len(prompt) for prompt in prompts)
        if longest == 0:
            raise invalid(f"the {prompt_param} is empty after tokenization", prompt_param, "empty_prompt")
        vocab = self.model.config.vocab_size
        if any(not 0 <= token < vocab for prompt in prompts for token in prompt):
            raise invalid(f"token ids in the {prompt_param} must be in [0, {vocab})", prompt_param, "invalid_value")
        max_tokens = self._max_tokens(request.new_tokens, longest, prompt_param)
        rows = len(prompts) * request.n
        if rows > self.settings.max_batch_rows:
            raise invalid(f"{len(prompts)} prompts x n={request.n} is {rows} rows; this server runs at most "
                          f"{self.settings.max_batch_rows} per request (bloombee-api --max-batch-rows)", "n", "too_many_choices")
        job = Job(prompts=prompts, max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p, stops=stops,
                  seed=request.seed, n=request.n, loop=asyncio.get_running_loop())
        self.scheduler.submit(job)
        return Prepared(job, request.stream, request.include_usage)

    def _max_tokens(self, asked: int | None, prompt_tokens: int, prompt_param: str) -> int:
        """The request's new tokens, checked against the API's and the model's limits."""
        if asked is not None and asked > self.settings.max_tokens:
            raise invalid(f"max_tokens {asked} is over this server's limit of {self.settings.max_tokens} "
                          f"(bloombee-api --max-tokens)", "max_tokens", "max_tokens_exceeded")
        room = self.context_length - prompt_tokens if self.context_length else None
        if room is not None and room < 1 or asked is not None and room is not None and asked > room:
            wanted = asked if asked is not None else 1
            raise invalid(f"this model's maximum context length is {self.context_length} tokens, but you requested "
                          f"{prompt_tokens + wanted} tokens ({prompt_tokens} in the {prompt_param}, {wanted} for the "
                          f"completion); shorten the {prompt_param} or lower max_tokens", prompt_param,
                          "context_length_exceeded")
        default = min(self.settings.default_max_tokens, room) if room is not None else self.settings.default_max_tokens
        return asked if asked is not None else default

    def swarm_status(self) -> ModelStatus:
        """The swarm's records for this model, read now from the DHT (blocking: run it in a thread)."""
        remote = self.model.remote
        return model_status(remote.dht, self.name, remote.manager.prefix, remote.manager.num_blocks)
