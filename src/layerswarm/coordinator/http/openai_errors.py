"""Errors of the OpenAI-compatible API, in OpenAI's format and mapped here only:

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

    400 invalid_request_error   bad parameters, a prompt over the context, max_tokens over the limit,
                                n > 1 and other things this server does not do (param names the field)
    404 invalid_request_error   unknown model (code model_not_found)
    429 rate_limit_error        too many requests in flight (code busy)
    503 server_error            too few blocks reachable, or a stream that could not go on

The routes raise what the rest of the coordinator raises (InvalidGeneration, DepthError, StreamFailed,
the front door's ApiError, pydantic's ValidationError) and `as_openai_error` turns it into one OpenAIError;
inside a started event stream the same body is sent as an event (`error_event`).
"""

from __future__ import annotations

from typing import Any, TypedDict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..generation.options import InvalidGeneration
from ..generation.runner import StreamFailed
from ..routing.request import InvalidRequest
from ..routing.trace import DepthError
from .errors import ApiError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}


class ErrorBody(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body: ErrorBody = {
            "message": message,
            "type": TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }


def validation_error(exc: ValidationError) -> OpenAIError:
    """pydantic's first complaint, with the field it is about as `param` (no input echoed back)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body", None, "invalid_value")
    first = errors[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {param}", param, "unrecognized_argument")
    return OpenAIError(400, f"{param}: {first['msg']}", param, "invalid_value")


def as_openai_error(exc: Exception) -> OpenAIError:
    """What the rest of the coordinator raises, as OpenAI's error."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidGeneration):
        return OpenAIError(400, str(exc), exc.param, exc.code)
    if isinstance(exc, InvalidRequest):
        return OpenAIError(400, str(exc), None, "invalid_request")
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if isinstance(exc, DepthError):
        return OpenAIError(503, str(exc), None, "insufficient_depth")
    if isinstance(exc, StreamFailed):
        return OpenAIError(503, str(exc), None, "stream_failed")
    if isinstance(exc, ApiError):
        return OpenAIError(exc.status_code, str(exc.detail), None, exc.error)
    raise TypeError(f"no OpenAI error for {type(exc).__name__}") from exc


MAPPED = (OpenAIError, InvalidRequest, ValidationError, DepthError, StreamFailed, ApiError)


def error_event(exc: Exception) -> dict[str, Any]:
    """The error as a started event stream carries it (`data: {"error": {...}}`, then the stream ends)."""
    return {"error": as_openai_error(exc).body}


def install_openai_errors(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"error": exc.body})
