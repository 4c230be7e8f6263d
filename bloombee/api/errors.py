"""API errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    """A request the API cannot serve; carries the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """HTTP 400: the request itself is wrong or over a limit."""
    return APIError(400, message, "invalid_request_error", param, code)


def queue_full(waiting: int) -> APIError:
    return APIError(429, f"the server is busy: {waiting} requests are already waiting for the swarm; retry later",
                    "rate_limit_error", None, "queue_full")


def swarm_unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "swarm_unavailable")


async def api_error_handler(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def validation_error_handler(request: Request, error: RequestValidationError) -> JSONResponse:
    """Pydantic's complaint about the body, as one OpenAI-style 400 naming the first wrong field."""
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return JSONResponse(invalid(message, param, "invalid_value").body(), status_code=400)
