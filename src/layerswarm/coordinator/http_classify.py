"""POST /v1/classify: one image in (multipart upload or JSON base64), labels and the path's trace out.

Order of checks, cheapest first and nothing read before it is needed: content type (415), admission
(429), a body-read slot (429), the body streamed under its size limit (413), the options (422),
the image header against the pixel budget (413) and the model's size (422), decoding in a worker
(400), then the swarm (503 when too few blocks are reachable).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .bodies import read_form, read_json_object
from .core import Classification, ClassifyOptions, Coordinator
from .executor import DepthError
from .http_errors import ApiError, describe
from .imaging import Decoder
from .limits import Gate
from .planner import Policy

FORM_OVERHEAD_BYTES = 64 * 1024  # multipart boundaries, part headers and option fields around the image


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

    def options(self) -> ClassifyOptions:
        return ClassifyOptions(
            top_k=self.top_k,
            policy=Policy(self.policy) if self.policy else None,
            seed=self.seed,
            min_blocks=self.min_blocks,
            max_blocks=self.max_blocks,
            exit_confidence=self.exit_confidence,
        )


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
JSON, MULTIPART = "application/json", "multipart/form-data"


def classify_router(coordinator: Coordinator, gate: Gate, decoder: Decoder) -> APIRouter:
    router = APIRouter()
    limit = coordinator.settings.max_upload_bytes
    cfg = coordinator.config

    @router.post(
        "/v1/classify",
        response_model=ClassifyResponse,
        openapi_extra=CLASSIFY_BODY,
        responses={400: {}, 401: {}, 408: {}, 413: {}, 415: {}, 422: {}, 429: {}, 503: {}},
    )
    async def classify(request: Request) -> ClassifyResponse:
        """Classify one image: upload it as multipart `file`, or POST JSON with `image_base64`."""
        content_type = _content_type(request)
        async with gate.admit():
            if content_type == JSON:
                image, params = await _read_json(gate, request, limit)
            else:
                image, params = await _read_multipart(gate, request, limit)
            images = await decoder.to_batch(image, params.resize)
            try:
                with coordinator.metrics.latency.time():
                    result = await coordinator.classify(images, params.options())
            except DepthError as exc:
                raise ApiError(503, "insufficient_depth", str(exc)) from exc
        return _response(result, cfg.class_names, params.top_k)

    return router


def _content_type(request: Request) -> str:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in (JSON, MULTIPART):
        raise ApiError(
            415,
            "unsupported_media_type",
            "send multipart/form-data with a `file` part, or application/json with `image_base64`",
        )
    return content_type


async def _read_json(gate: Gate, request: Request, limit: int) -> tuple[bytes, ClassifyParams]:
    data = await read_json_object(gate, request, limit * 4 // 3 + FORM_OVERHEAD_BYTES)
    try:
        params = ClassifyJson.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", describe(exc.errors())) from exc
    try:
        image = base64.b64decode(params.image_base64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(400, "invalid_base64", f"image_base64 is not valid base64: {exc}") from exc
    if len(image) > limit:
        raise ApiError(413, "too_large", f"image over the {limit}-byte upload limit")
    return image, ClassifyParams.model_validate(params.model_dump(exclude={"image_base64"}))


async def _read_multipart(gate: Gate, request: Request, limit: int) -> tuple[bytes, ClassifyParams]:
    files, fields = await read_form(gate, request, limit + FORM_OVERHEAD_BYTES)
    if set(files) != {"file"}:
        raise ApiError(422, "invalid_request", "multipart body needs one file part, named `file`, with the image")
    image = files["file"]
    if len(image) > limit:
        raise ApiError(413, "too_large", f"image over the {limit}-byte upload limit")
    try:
        return image, ClassifyParams.model_validate({k: v for k, v in fields.items() if v != ""})
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", describe(exc.errors())) from exc


def _response(result: Classification, class_names: tuple[str, ...], top_k: int) -> ClassifyResponse:
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
