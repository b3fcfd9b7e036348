"""The coordinator's HTTP API (FastAPI): classify, the swarm view, probes, metrics.

Every error is JSON {"error": code, "detail": reason} with a 4xx status (503 when the swarm is too
thin to answer); nothing reaches a client as a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from layerswarm import __version__

from .activity import Activity
from .auth import ApiKeys
from .bodies import read_form, read_json_object
from .core import Classification, ClassifyOptions, Coordinator
from .executor import PathResult
from .exits import ExitRuleError
from .front_door import FrontDoor
from .http_errors import ApiError, describe, error_response
from .http_text import mount_text
from .images import ImageError, decode_batch
from .imaging import Decoder
from .kserve import mount_kserve
from .limits import Gate
from .page import mount_page
from .planner import Policy
from .serving import Busy, TooThin, classify_batch

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
    exit_rule: Literal["confidence", "entropy", "patience", "none"] | None = Field(
        None, description="early-exit rule (any path order); default: the coordinator's (calibrated) rule"
    )
    exit_threshold: float | None = Field(
        None,
        ge=0.0,
        le=1024,
        description="the rule's threshold: confidence in (0, 1], entropy / log(classes) in [0, 1], patience in "
        "hops; default: the calibrated threshold",
    )
    deadline_ms: float | None = Field(
        None, gt=0.0, le=600_000, description="anytime: answer with what ran once the next hop would miss this budget"
    )
    ensemble: int = Field(1, ge=1, le=8, description="routes through the swarm whose logits are averaged")
    ensemble_mode: Literal["adaptive", "parallel"] = Field(
        "adaptive", description="adaptive: another route only while the answer is unsure; parallel: all at once"
    )
    ensemble_confidence: float | None = Field(
        None, gt=0.0, le=1.0, description="adaptive ensembles: add a route while below this; default: calibrated"
    )
    repeats: bool | None = Field(
        None, description="run reachable blocks again when too few indices are reachable; default: as calibrated"
    )
    resize: bool = Field(False, description="resize images of another size instead of refusing them")
    label: str | None = Field(
        None, max_length=256, description="the true class, if known: counted in the swarm page's accuracy"
    )


class ClassifyJson(ClassifyParams):
    image_base64: str = Field(..., description="the image file (PNG, JPEG, ...), base64-encoded")


class BatchItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image_base64: str = Field(..., description="the image file (PNG, JPEG, ...), base64-encoded")
    label: str | None = Field(None, max_length=256, description="the true class, if known")


class BatchJson(ClassifyParams):
    images: list[BatchItem] = Field(..., min_length=1, description="the batch, in order")


class Label(BaseModel):
    index: int
    label: str
    probability: float


class ItemResult(BaseModel):
    prediction: str
    labels: list[Label]


class BatchResponse(BaseModel):
    results: list[ItemResult] = Field(description="one per input, in order")
    policy: str
    seed: int
    depth: int = Field(description="blocks that ran (the whole batch took one path)")
    exited_early: bool
    elapsed_ms: float
    trace: dict[str, Any] = Field(description="per hop: node, model, block, position, latency, substitutions")


class ClassifyResponse(BaseModel):
    prediction: str
    labels: list[Label]
    policy: str
    seed: int
    depth: int = Field(description="blocks that ran")
    exited_early: bool
    exit_rule: str | None = Field(None, description="the rule that ended a route early")
    anytime: bool = Field(False, description="answered early because the deadline left no time for the next hop")
    routes: int = Field(1, description="routes whose logits were averaged (ensembles)")
    blocks: int = Field(0, description="blocks run, all routes together")
    elapsed_ms: float
    trace: dict[str, Any] = Field(description="per hop: node, model, block, position, latency, substitutions")


_error = error_response
_describe = describe


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


BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "array", "items": {"type": "string", "format": "binary"}},
                        **ClassifyParams.model_json_schema()["properties"],
                        "label": {"type": "array", "items": {"type": "string"}},
                    },
                }
            },
            "application/json": {"schema": BatchJson.model_json_schema()},
        },
    }
}


def create_app(coordinator: Coordinator) -> FastAPI:
    settings = coordinator.settings
    cfg = coordinator.config
    activity = Activity()  # recent requests and rates, for the swarm page
    # Swagger UI and ReDoc assets come from the installed package, not a CDN: /docs works offline.
    app = FastAPIOffline(
        title="layerswarm coordinator",
        version=__version__,
        description="Classify images through a swarm of block nodes, in any order.",
    )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if request.url.path.startswith("/v1/classify"):
            activity.record_rejection("v1", exc.status_code, exc.error)
        return _error(exc.status_code, exc.error, exc.detail)

    @app.exception_handler(StarletteHTTPException)  # routing 404/405 come from Starlette itself
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http_error", exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "invalid_request", _describe(exc.errors()))

    # Outermost: API keys, every status counted, quiet disconnects, bugs answered as JSON 500.
    app.add_middleware(FrontDoor, keys=ApiKeys(settings.api_keys), metrics=coordinator.metrics)
    gate = Gate(settings.max_concurrent_requests, settings.max_body_reads, coordinator.metrics)
    decoder = Decoder(cfg.image_size, settings.max_image_pixels, coordinator.metrics.decoding)
    app.state.gate, app.state.decoder = gate, decoder  # server.py closes the decoder's threads

    @app.post(
        "/v1/classify",
        response_model=ClassifyResponse,
        openapi_extra=CLASSIFY_BODY,
        responses={400: {}, 413: {}, 415: {}, 422: {}, 429: {}, 503: {}},
    )
    async def classify(request: Request) -> ClassifyResponse:
        """Classify one image: upload it as multipart `file`, or POST JSON with `image_base64`."""
        content_type = _content_type(request)
        async with gate.admit():  # 429 from the headers alone, before any body is read
            image_bytes, params = await _read_request(gate, request, content_type, settings.max_upload_bytes)
            images = await decoder.to_batch(image_bytes, params.resize)  # pixel budget, then a worker
            result = await _classify(images, params, [params.label])
        return _response(result, cfg.class_names, params.top_k)

    @app.post(
        "/v1/classify/batch",
        response_model=BatchResponse,
        openapi_extra=BATCH_BODY,
        responses={400: {}, 413: {}, 415: {}, 422: {}, 429: {}, 503: {}},
    )
    async def classify_many(request: Request) -> BatchResponse:
        """Classify several images as one batch (one path through the swarm, one call per hop): upload
        several multipart `file` parts (optional `label` fields, one per file), or POST JSON with `images`."""
        async with gate.admit():  # 429 from the headers alone, before any body is read
            blobs, truths, params = await _read_batch(request, settings.max_upload_bytes, settings.max_batch)
            images = await asyncio.to_thread(_decode, blobs, cfg.image_size, params.resize)
            result = await _classify(images, params, truths)
        return _batch_response(result, cfg.class_names, params.top_k)

    async def _classify(images: torch.Tensor, params: ClassifyParams, truths: Sequence[str | None]) -> Classification:
        opts = ClassifyOptions(
            top_k=params.top_k,
            policy=Policy(params.policy) if params.policy else None,
            seed=params.seed,
            min_blocks=params.min_blocks,
            max_blocks=params.max_blocks,
            exit_confidence=params.exit_confidence,
            exit_rule=params.exit_rule,
            exit_threshold=params.exit_threshold,
            deadline_ms=params.deadline_ms,
            ensemble=params.ensemble,
            ensemble_mode=params.ensemble_mode,
            ensemble_confidence=params.ensemble_confidence,
            repeats=params.repeats,
        )
        try:
            result, _ = await classify_batch(coordinator, activity, images, opts, truths)
        except ExitRuleError as exc:  # an exit rule without a threshold, or one out of the rule's range
            raise ApiError(422, "invalid_request", str(exc)) from exc
        except Busy as exc:
            raise ApiError(429, "busy", str(exc)) from exc
        except TooThin as exc:
            raise ApiError(503, "insufficient_depth", str(exc)) from exc
        return result

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

    mount_kserve(app, coordinator, activity)
    mount_page(app, coordinator, activity)
    mount_text(app, coordinator, activity, gate)  # POST /v1/classify/text (coordinator/http_text.py)
    return app


JSON, MULTIPART = "application/json", "multipart/form-data"
FORM_OVERHEAD_BYTES = 64 * 1024  # multipart boundaries, part headers and option fields around the image


def _content_type(request: Request) -> str:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in (JSON, MULTIPART):
        raise ApiError(
            415,
            "unsupported_media_type",
            "send multipart/form-data with a `file` part, or application/json with `image_base64`",
        )
    return content_type


async def _read_request(gate: Gate, request: Request, content_type: str, limit: int) -> tuple[bytes, ClassifyParams]:
    """The image and options; the body streamed under its limit (413), strict JSON (400), in memory."""
    if content_type == JSON:
        data = await read_json_object(gate, request, limit * 4 // 3 + FORM_OVERHEAD_BYTES)
        try:
            params = ClassifyJson.model_validate(data)
        except ValidationError as exc:
            raise ApiError(422, "invalid_request", _describe(exc.errors())) from exc
        try:
            image = base64.b64decode(params.image_base64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ApiError(400, "invalid_base64", f"image_base64 is not valid base64: {exc}") from exc
        if len(image) > limit:
            raise ApiError(413, "too_large", f"image over the {limit}-byte upload limit")
        return image, ClassifyParams.model_validate(params.model_dump(exclude={"image_base64"}))
    files, fields = await read_form(gate, request, limit + FORM_OVERHEAD_BYTES)
    if set(files) != {"file"}:
        raise ApiError(422, "invalid_request", "multipart body needs one file part, named `file`, with the image")
    if len(files["file"]) > limit:
        raise ApiError(413, "too_large", f"image over the {limit}-byte upload limit")
    try:
        return files["file"], ClassifyParams.model_validate({k: v for k, v in fields.items() if v != ""})
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", _describe(exc.errors())) from exc


_Batch = tuple[list[bytes], list[str | None], ClassifyParams]  # images, their true labels if given, options


async def _read_batch(request: Request, limit: int, max_batch: int) -> _Batch:
    """The images of a batch (each held to `limit` bytes, at most `max_batch`), their labels, options."""
    body_limit = limit * 4  # the whole batch
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > body_limit * 4 // 3 + 64 * 1024):
        raise ApiError(413, "too_large", f"request body over the {body_limit}-byte batch limit")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json":
        body = await _read_limited(request, body_limit * 4 // 3 + 64 * 1024)
        try:
            batch = BatchJson.model_validate(json.loads(body))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurd nesting
            raise ApiError(400, "invalid_json", f"body is not JSON: {exc}") from exc
        except ValidationError as exc:
            raise ApiError(422, "invalid_request", _describe(exc.errors())) from exc
        _check_batch(len(batch.images), max_batch, batch.label)
        images = []
        for index, item in enumerate(batch.images):
            try:
                images.append(base64.b64decode(item.image_base64, validate=True))
            except (binascii.Error, ValueError) as exc:
                raise ApiError(400, "invalid_base64", f"images.{index}.image_base64 is not base64: {exc}") from exc
            if len(images[-1]) > limit:
                raise ApiError(413, "too_large", f"image {index} over the {limit}-byte upload limit")
        params = ClassifyParams.model_validate(batch.model_dump(exclude={"images"}))
        return images, [item.label for item in batch.images], params
    if content_type == "multipart/form-data":
        form = await request.form(max_files=max_batch + 1, max_fields=16 + max_batch, max_part_size=limit)
        uploads = form.getlist("file")
        if not uploads or not all(isinstance(u, UploadFile) for u in uploads):
            raise ApiError(422, "invalid_request", "multipart body needs one or more `file` parts with the images")
        labels = form.getlist("label")
        _check_batch(len(uploads), max_batch, None)
        if labels and (len(labels) != len(uploads) or not all(isinstance(v, str) for v in labels)):
            raise ApiError(422, "invalid_request", f"{len(labels)} `label` fields for {len(uploads)} files")
        images = [await u.read(limit + 1) for u in uploads if isinstance(u, UploadFile)]
        if any(len(image) > limit for image in images):
            raise ApiError(413, "too_large", f"an image is over the {limit}-byte upload limit")
        fields = {k: v for k, v in form.multi_items() if k not in ("file", "label")}
        if any(not isinstance(v, str) for v in fields.values()):
            raise ApiError(422, "invalid_request", "files go in `file` parts only")
        try:
            params = ClassifyParams.model_validate({k: v for k, v in fields.items() if v != ""})
        except ValidationError as exc:
            raise ApiError(422, "invalid_request", _describe(exc.errors())) from exc
        return images, [str(v) or None for v in labels] or [None] * len(images), params
    raise ApiError(
        415,
        "unsupported_media_type",
        "send multipart/form-data with `file` parts, or application/json with `images`",
    )


def _check_batch(size: int, max_batch: int, top_level_label: str | None) -> None:
    if size > max_batch:
        raise ApiError(413, "batch_too_large", f"{size} images in one batch, at most {max_batch}")
    if top_level_label is not None:
        raise ApiError(422, "invalid_request", "in a batch, give each image its own `label`")


async def _read_limited(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "too_large", f"request body over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _to_batch(image: bytes, size: int, resize: bool) -> torch.Tensor:
    return _decode([image], size, resize)


def _decode(images: Sequence[bytes], size: int, resize: bool) -> torch.Tensor:
    try:
        return decode_batch(images, size, resize)
    except ImageError as exc:
        raise ApiError(exc.status, exc.error, exc.detail) from exc


def _top_labels(probs: torch.Tensor, class_names: tuple[str, ...], top_k: int) -> list[Label]:
    values, indices = probs.topk(min(top_k, probs.numel()))
    names = class_names or tuple(str(i) for i in range(probs.numel()))
    return [
        Label(index=int(i), label=names[int(i)], probability=round(float(p), 6))
        for p, i in zip(values, indices, strict=True)
    ]


def _trace(path: PathResult, result: Classification | None = None) -> dict[str, Any]:
    return {
        "hops": [h.to_json() for h in path.hops],
        "unreachable_blocks": path.unreachable,
        "substituted": sum(h.outcome == "substituted" for h in path.hops),
        "skipped": sum(h.outcome == "skipped" for h in path.hops),
        **path.topology_trace(),
        **(_adaptive_trace(result) if result is not None else {}),
    }


def _response(result: Classification, class_names: tuple[str, ...], top_k: int) -> ClassifyResponse:
    labels = _top_labels(result.probs[0], class_names, top_k)
    return ClassifyResponse(
        prediction=labels[0].label,
        labels=labels,
        policy=result.policy.value,
        seed=result.seed,
        depth=result.path.depth,
        exited_early=result.path.exited_early,
        exit_rule=result.exit_rule,
        anytime=any(r.path.anytime for r in result.ensemble.routes),
        routes=len(result.ensemble.routes),
        blocks=sum(r.path.depth for r in result.ensemble.routes),
        elapsed_ms=round(result.elapsed_ms, 3),
        trace=_trace(result.path, result),
    )


def _batch_response(result: Classification, class_names: tuple[str, ...], top_k: int) -> BatchResponse:
    results = []
    for probs in result.probs:
        labels = _top_labels(probs, class_names, top_k)
        results.append(ItemResult(prediction=labels[0].label, labels=labels))
    return BatchResponse(
        results=results,
        policy=result.policy.value,
        seed=result.seed,
        depth=result.path.depth,
        exited_early=result.path.exited_early,
        elapsed_ms=round(result.elapsed_ms, 3),
        trace=_trace(result.path),
    )


def _adaptive_trace(result: Any) -> dict[str, Any]:
    """Early exit, anytime and ensemble routes in the trace (the first route's hops are `hops`)."""
    ensemble = result.ensemble
    return {
        "exit": {"rule": result.exit_rule, "depth": result.path.depth} if result.exit_rule else None,
        "anytime": any(r.path.anytime for r in ensemble.routes),
        "ensemble": {
            "requested": ensemble.requested,
            "mode": ensemble.mode,
            "routes": [
                {"depth": r.path.depth, "exited_early": r.path.exited_early, "anytime": r.path.anytime}
                for r in ensemble.routes
            ],
            "extra_route_hops": [[h.to_json() for h in r.path.hops] for r in ensemble.routes[1:]],
            "failed": ensemble.failed,
        },
    }
