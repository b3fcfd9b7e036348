"""Errors of the HTTP API: every one is JSON {"error": code, "detail": reason} with its status."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(HTTPException):
    def __init__(self, status: int, error: str, detail: Any) -> None:
        super().__init__(status_code=status, detail=detail)
        self.error = error


def error_response(status: int, error: str, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": error, "detail": detail}, headers=headers)


def describe(errors: Any) -> list[dict[str, Any]]:
    """pydantic's validation errors as [{field, problem}] (no input echoed back)."""
    return [{"field": ".".join(str(p) for p in e.get("loc", ())), "problem": e.get("msg", "")} for e in errors]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status_code, exc.error, exc.detail)

    @app.exception_handler(StarletteHTTPException)  # routing 404/405 come from Starlette itself
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, "http_error", exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", describe(exc.errors()))
