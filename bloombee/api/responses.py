"""OpenAI's response bodies and stream chunks for completions and chat completions."""

import json
import time
import uuid
from dataclasses import dataclass, field


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass
class ResponseFormat:
    """Builds one response's bodies; `chat` chooses chat.completion over text_completion."""

    model: str
    chat: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, index: int, text: str, finish: str | None, chunk: bool) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        content = {"role": "assistant", "content": text}
        if chunk:
            return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
        return {"index": index, "message": content, "logprobs": None, "finish_reason": finish}

    def body(self, texts: dict[int, str], finishes: dict[int, str], usage: Usage) -> dict:
        """The whole (non-streamed) response."""
        choices = [self._choice(index, texts.get(index, ""), finishes.get(index, "length"), False) for index in sorted(finishes)]
        return {**self._envelope(False), "choices": choices, "usage": usage.body()}

    def opening(self, choices: int) -> list[dict]:
        """Chunks sent before any token: the assistant role of each chat choice."""
        if not self.chat:
            return []
        return [{**self._envelope(True), "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]}
                for index in range(choices)]

    def chunk(self, index: int, text: str, finish: str | None = None) -> dict:
        return {**self._envelope(True), "choices": [self._choice(index, text, finish, True)]}

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage.body()}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
