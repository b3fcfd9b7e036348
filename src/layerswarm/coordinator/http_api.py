"""The coordinator's HTTP API (FastAPI): classify, the swarm view, probes, metrics.

Every error is JSON {"error": code, "detail": reason} with a 4xx status (503 when the swarm is too
thin to answer); nothing reaches a client as a traceback.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from typing import Any, Literal

import numpy as np
import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from PIL import Image, UnidentifiedImageError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from layerswarm import __version__
from layerswarm.models.data import decode_image

from .core import ClassifyOptions, Coordinator
from .executor import DepthError
from .planner import Policy

log = logging.getLogger(__name__)


class ClassifyParams(BaseModel):
    """Options of one classification (JSON fields, or form fields next to the uploaded file)."""

    model_config = ConfigDict(extra="forbid")
    top_k: int = Field(5, ge=1, le=1000, description="how many labels to return")
    policy: Literal["sequential", "shuffle", "fastest"] | None = Field(
        None, description="path policy; default: shuffle for shuffle-robust families, else sequential"
    )
    seed: int | None = Field(None, ge=0, lt=2**31, description="seed of the random path choices (repeatable)")
    min_blocks: int | None = Field(None, ge=0, le=1024, description="fail with 503 below this many blocks")
    max_blocks: int | None = Field(None, ge=1, le=1024, description="prune the path to at most this many")
    exit_confidence: float | None = Field(
        None, gt=0.0, le=1.0, description="early exit: stop once the top class has this probability"
    )
    resize: bool = Field(False, description="resize images of another size instead of refusing them")


class ClassifyJson(ClassifyParams):
    image_base64: str = Field(..., description="the image file (PNG, JPEG, ...), base64-encoded")


class Label(BaseModel):
    index: int
    label: str
    probability: float


class ClassifyResponse(BaseModel):
    prediction: str
    labels: list[Label]
    policy: str
    seed: int
    depth: int = Field(description="blocks that ran")
    exited_early: bool
    elapsed_ms: float
    trace: dict[str, Any] = Field(description="per hop: node, model, block, position, latency, substitutions")


class ApiError(HTTPException):
    def __init__(self, status: int, error: str, detail: Any) -> None:
        super().__init__(status_code=status, detail=detail)
        self.error = error


def _error(status: int, error: str, detail: Any) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": error, "detail": detail})


CLASSIFY_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        **ClassifyParams.model_json_schema()["properties"],
                    },
                }
            },
            "application/json": {"schema": ClassifyJson.model_json_schema()},
        },
    }
}


def create_app(coordinator: Coordinator) -> FastAPI:
    settings = coordinator.settings
    cfg = coordinator.config
    app = FastAPI(
        title="layerswarm coordinator",
        version=__version__,
        description="Classify images through a swarm of block nodes, in any order.",
    )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status_code, exc.error, exc.detail)

    @app.exception_handler(StarletteHTTPException)  # routing 404/405 come from Starlette itself
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http_error", exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "invalid_request", _describe(exc.errors()))

    @app.middleware("http")
    async def _unexpected(request: Request, call_next: Any) -> Response:
        """A bug must not reach the client as a traceback or a dropped connection: log it, answer JSON.
        (Starlette's own catch-all re-raises after answering, which resets keep-alive connections.)"""
        try:
            return await call_next(request)
        except Exception as exc:
            log.exception("unexpected error on %s", request.url.path)
            return _error(500, "internal", f"{type(exc).__name__}: {exc}")

    @app.post(
        "/v1/classify",
        response_model=ClassifyResponse,
        openapi_extra=CLASSIFY_BODY,
        responses={400: {}, 413: {}, 415: {}, 422: {}, 429: {}, 503: {}},
    )
    async def classify(request: Request) -> ClassifyResponse:
        """Classify one image: upload it as multipart `file`, or POST JSON with `image_base64`."""
        image_bytes, params = await _read_request(request, settings.max_upload_bytes)
        images = _to_batch(image_bytes, cfg.image_size, params.resize)
        if coordinator.in_flight >= settings.max_concurrent_requests:
            raise ApiError(429, "busy", f"{coordinator.in_flight} requests in flight; retry shortly")
        opts = ClassifyOptions(
            top_k=params.top_k,
            policy=Policy(params.policy) if params.policy else None,
            seed=params.seed,
            min_blocks=params.min_blocks,
            max_blocks=params.max_blocks,
            exit_confidence=params.exit_confidence,
        )
        coordinator.begin_request()
        try:
            with coordinator.metrics.latency.time():
                result = await coordinator.classify(images, opts)
        except DepthError as exc:
            coordinator.metrics.requests.labels("503").inc()
            raise ApiError(503, "insufficient_depth", str(exc)) from exc
        finally:
            coordinator.end_request()
        coordinator.metrics.requests.labels("200").inc()
        return _response(result, cfg.class_names, params.top_k)

    @app.get("/v1/nodes")
    async def nodes() -> dict[str, Any]:
        """The swarm as this coordinator sees it, ignored nodes (and why) included."""
        ready, reason = coordinator.ready()
        return {
            "family_id": coordinator.manifest.family_id,
            "model_id": coordinator.manifest.model_id,
            "variant": cfg.variant,
            "depth": cfg.depth,
            "reachable_depth": coordinator.registry.reachable_depth(),
            "ready": ready,
            "reason": reason,
            "nodes": coordinator.registry.snapshot(),
        }

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {}})
    async def readyz() -> JSONResponse:
        """Readiness: the family's minimum depth is reachable."""
        ready, reason = coordinator.ready()
        return JSONResponse(
            status_code=200 if ready else 503, content={"status": "ready" if ready else "not_ready", "detail": reason}
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics."""
        return Response(generate_latest(coordinator.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _read_request(request: Request, limit: int) -> tuple[bytes, ClassifyParams]:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit + 64 * 1024):
        raise ApiError(413, "too_large", f"request body over the {limit}-byte upload limit")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json":
        body = await _read_limited(request, limit * 4 // 3 + 64 * 1024)
        try:
            data = json.loads(body)
            params = ClassifyJson.model_validate(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, "invalid_json", f"body is not JSON: {exc}") from exc
        except ValidationError as exc:
            raise ApiError(422, "invalid_request", _describe(exc.errors())) from exc
        try:
            image = base64.b64decode(params.image_base64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ApiError(400, "invalid_base64", f"image_base64 is not valid base64: {exc}") from exc
        return image, ClassifyParams.model_validate(params.model_dump(exclude={"image_base64"}))
    if content_type == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=16, max_part_size=limit)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError(422, "invalid_request", "multipart body needs a `file` part with the image")
        image = await upload.read(limit + 1)
        if len(image) > limit:
            raise ApiError(413, "too_large", f"image over the {limit}-byte upload limit")
        fields = {k: v for k, v in form.items() if k != "file"}
        if any(not isinstance(v, str) for v in fields.values()):
            raise ApiError(422, "invalid_request", "only one file part (`file`) is accepted")
        try:
            return image, ClassifyParams.model_validate({k: v for k, v in fields.items() if v != ""})
        except ValidationError as exc:
            raise ApiError(422, "invalid_request", _describe(exc.errors())) from exc
    raise ApiError(
        415,
        "unsupported_media_type",
        "send multipart/form-data with a `file` part, or application/json with `image_base64`",
    )


async def _read_limited(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "too_large", f"request body over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _to_batch(image: bytes, size: int, resize: bool) -> torch.Tensor:
    if not image:
        raise ApiError(400, "empty_image", "the image is empty")
    try:
        with Image.open(_bytes(image)) as probe:
            width, height = probe.size
            if width * height > 4096 * 4096:
                raise ApiError(413, "too_large", f"image of {width}x{height} pixels is too large")
        if (width, height) != (size, size) and not resize:
            raise ApiError(
                422, "wrong_size", f"image is {width}x{height}, the model takes {size}x{size} (or pass resize=true)"
            )
        array = decode_image(image, size if resize else None)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ApiError(400, "invalid_image", f"cannot decode the image: {exc}") from exc
    return torch.from_numpy(np.ascontiguousarray(array))[None]


def _bytes(data: bytes):  # type: ignore[no-untyped-def]
    import io

    return io.BytesIO(data)


def _response(result: Any, class_names: tuple[str, ...], top_k: int) -> ClassifyResponse:
    probs = result.probs[0]
    k = min(top_k, probs.numel())
    values, indices = probs.topk(k)
    names = class_names or tuple(str(i) for i in range(probs.numel()))
    labels = [
        Label(index=int(i), label=names[int(i)], probability=round(float(p), 6))
        for p, i in zip(values, indices, strict=True)
    ]
    path = result.path
    trace = {
        "hops": [h.to_json() for h in path.hops],
        "unreachable_blocks": path.unreachable,
        "substituted": sum(h.outcome == "substituted" for h in path.hops),
        "skipped": sum(h.outcome == "skipped" for h in path.hops),
    }
    return ClassifyResponse(
        prediction=labels[0].label,
        labels=labels,
        policy=result.policy.value,
        seed=result.seed,
        depth=path.depth,
        exited_early=path.exited_early,
        elapsed_ms=round(result.elapsed_ms, 3),
        trace=trace,
    )


def _describe(errors: Any) -> list[dict[str, Any]]:
    return [{"field": ".".join(str(p) for p in e.get("loc", ())), "problem": e.get("msg", "")} for e in errors]
