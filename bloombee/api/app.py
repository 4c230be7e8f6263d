"""The FastAPI application: routes, OpenAI-style error handlers, and the scheduler running beside them."""

import asyncio
import contextlib

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from bloombee.api.engine import Engine
from bloombee.api.errors import APIError, api_error_handler, validation_error_handler
from bloombee.api.routes import build_router


def create_app(engine: Engine) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler = asyncio.create_task(engine.scheduler.serve())
        try:
            yield
        finally:
            scheduler.cancel()

    app = FastAPI(title="BloomBee OpenAI-compatible API", lifespan=lifespan)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.include_router(build_router(engine))
    engine.metrics.instrument(app)
    return app
