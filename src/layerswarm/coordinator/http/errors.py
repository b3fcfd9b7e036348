"""Errors of the native API: every one is JSON {"error": code, "detail": reason} with its status, mapped
here and only here (KServe v2 maps the same failures to its own format in kserve.py).

An inference route's failures (refused input, busy, too few blocks) are also drawn on the swarm page,
once each, with the batch size when the route knew it (`request.state.batch`).
"""

from __future__ import annotations

from typing import Any, TypedDict

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..generation.runner import StreamFailed
from ..routing.request import InvalidRequest
from ..routing.trace import DepthError
from .activity import MAX_ERROR_CHARS, Activity

INFERENCE = "/v1/classify"  # the native inference routes (images, batches, text) start so
INVALID, TOO_THIN = (422, "invalid_request"), (503, "insufficient_depth")


class Problem(TypedDict):
    field: str  # dotted path of the field in the body
    problem: str


class ApiError(HTTPException):
    def __init__(self, status: int, error: str, detail: Any) -> None:
        super().__init__(status_code=status, detail=detail)
        self.error = error


def error_response(status: int, error: str, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": error, "detail": detail}, headers=headers)


def describe(errors: Any) -> list[Problem]:
    """pydantic's validation errors as [{field, problem}] (no input echoed back)."""
    return [{"field": ".".join(str(p) for p in e.get("loc", ())), "problem": e.get("msg", "")} for e in errors]


def batch_of(request: Request) -> int:
    """The items a failed inference request carried, once its route knew them (0 before)."""
    return int(getattr(request.state, "batch", 0))


def install_native_errors(app: FastAPI, activity: Activity) -> None:
    """The native API's one error map: the front door's and the routes' ApiError, the caller's mistakes
    (InvalidRequest: 422), too few blocks (DepthError: 503), a stream that cannot go on (StreamFailed:
    503), and Starlette's and FastAPI's own."""

    def answer(request: Request, status: int, error: str, detail: Any) -> JSONResponse:
        if request.url.path.startswith(INFERENCE):
            activity.record_failure("v1", batch_of(request), status, error[:MAX_ERROR_CHARS])
        return error_response(status, error, detail)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc.status_code, exc.error, exc.detail)

    @app.exception_handler(InvalidRequest)  # e.g. an exit rule out of range, min_blocks past the depth
    async def _invalid(request: Request, exc: InvalidRequest) -> JSONResponse:
        return answer(request, *INVALID, str(exc))

    @app.exception_handler(DepthError)
    async def _too_thin(request: Request, exc: DepthError) -> JSONResponse:
        if request.url.path.startswith(INFERENCE):
            activity.record_failure("v1", batch_of(request), TOO_THIN[0], TOO_THIN[1])
        # the block indices no node answered for, named for the operator who has to bring one back
        content = {"error": TOO_THIN[1], "detail": str(exc), "missing_blocks": exc.missing}
        return JSONResponse(status_code=TOO_THIN[0], content=content)

    @app.exception_handler(StreamFailed)  # generation: a stream no node could carry on (before it started)
    async def _stream_failed(request: Request, exc: StreamFailed) -> JSONResponse:
        return answer(request, 503, "stream_failed", str(exc))

    @app.exception_handler(StarletteHTTPException)  # routing 404/405 come from Starlette itself
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, "http_error", exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", describe(exc.errors()))
