"""Request bodies of the OpenAI-compatible endpoints (pydantic); unknown OpenAI fields are accepted and ignored."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1, description="new tokens per choice; the server's default when unset")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16, description="choices per prompt")
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not stop for stop in stops):
            raise ValueError(f"stop takes at most {MAX_STOP_SEQUENCES} non-empty strings")
        return stops

    @property
    def new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a text prompt (or several, or token ids) to continue."""

    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(item, int) for item in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = ""

    def text(self) -> str:
        """The message's text; content parts other than text are refused by the caller's check."""
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: a conversation, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
