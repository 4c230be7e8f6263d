"""The HTTP endpoints: /v1/models, /v1/completions, /v1/chat/completions, /status and /status.json."""

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from bloombee.api.engine import Engine, Prepared
from bloombee.api.generation import DONE, Delta, Failed, Finish
from bloombee.api.metrics import ApiMetrics
from bloombee.api.responses import ResponseFormat, Usage, sse
from bloombee.api.schemas import ChatCompletionRequest, CompletionRequest
from bloombee.api.status_page import render_status

logger = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 1.0


def build_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0, "owned_by": "bloombee"}]}

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(engine.completion(body), ResponseFormat(engine.name, chat=False), request, engine.metrics)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(engine.chat(body), ResponseFormat(engine.name, chat=True), request, engine.metrics)

    @router.get("/status.json")
    async def status_json() -> dict:
        status = await asyncio.to_thread(engine.swarm_status)
        return {"models": [status.model_dump()], "api": engine.stats()}

    @router.get("/status", response_class=HTMLResponse)
    async def status_page() -> str:
        status = await asyncio.to_thread(engine.swarm_status)
        return render_status(status, engine.stats(), engine.settings.status_refresh_seconds)

    return router


async def respond(prepared: Prepared, form: ResponseFormat, request: Request, metrics: ApiMetrics):
    if prepared.stream:
        return StreamingResponse(stream(prepared, form, metrics), media_type="text/event-stream")
    return await collect(prepared, form, request, metrics)


async def next_event(prepared: Prepared, request: Request):
    """The job's next event; cancels the job when the client has gone away meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(prepared.job.events.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                prepared.job.cancelled.set()
                logger.info("Client of request %d went away; cancelled it", prepared.job.id)
                return DONE


async def collect(prepared: Prepared, form: ResponseFormat, request: Request, metrics: ApiMetrics) -> JSONResponse:
    """A whole response at once."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = Usage(prepared.job.prompt_tokens)
    while (event := await next_event(prepared, request)) is not DONE:
        if isinstance(event, Delta):
            texts[event.choice] = texts.get(event.choice, "") + event.text
        elif isinstance(event, Finish):
            finishes[event.choice] = event.reason
            usage.completion_tokens += event.completion_tokens
            metrics.completion_tokens.inc(event.completion_tokens)
        elif isinstance(event, Failed):
            return JSONResponse(event.error.body(), status_code=event.error.status)
    return JSONResponse(form.body(texts, finishes, usage))


async def stream(prepared: Prepared, form: ResponseFormat, metrics: ApiMetrics) -> AsyncIterator[str]:
    """Server-sent events: one chunk per piece of text, a finish chunk per choice, usage if asked, [DONE]."""
    job = prepared.job
    usage = Usage(job.prompt_tokens)
    try:
        for chunk in form.opening(len(job.rows)):
            yield sse(chunk)
        while (event := await job.events.get()) is not DONE:
            if isinstance(event, Delta):
                yield sse(form.chunk(event.choice, event.text))
            elif isinstance(event, Finish):
                usage.completion_tokens += event.completion_tokens
                metrics.completion_tokens.inc(event.completion_tokens)
                yield sse(form.chunk(event.choice, "", event.reason))
            elif isinstance(event, Failed):
                yield sse(event.error.body())
                return
        if prepared.include_usage:
            yield sse(form.usage_chunk(usage))
        yield sse("[DONE]")
    finally:
        job.cancelled.set()  # finished, or the client went away: either way its rows need no more tokens
