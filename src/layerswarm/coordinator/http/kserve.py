"""The Open Inference Protocol (KServe v2 / Triton) over REST, beside the native API.

One model, named after the coordinator's model directory. Inputs: `images` FP32 [B, 3, H, W] in
[0, 1], or `images_encoded` BYTES [B] (PNG, JPEG, ...), plus an optional `label` BYTES [B] (true
classes, for the swarm page's accuracy). Outputs: `probabilities` FP32 [B, classes], `class_ids`
INT64 [B], `labels` BYTES [B]; the classification extension (`classification: k` on an output) and
the binary tensor extension are supported. Request parameters: policy, seed, min_blocks, max_blocks,
exit_confidence, resize. Errors are the protocol's `{"error": message}` with a 4xx status (503 when
the swarm is too thin to answer), mapped here and only here (`protocol_error`). A text family mounts
the metadata and health routes, not inference (app.py).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from layerswarm import __version__

from ..routing.request import ClassifyOptions, InvalidRequest
from ..routing.trace import DepthError
from .activity import MAX_ERROR_CHARS, Activity
from .bodies import MAX_INT_DIGITS, BodySlots, plain_int
from .errors import ApiError, batch_of
from .imaging import Decoder
from .inference import classify_batch, model_classes
from .kserve_codec import InferRequest, InputTensor, OutputTensor, ProtocolError, encode_response, parse_request
from .schemas import MAX_LABEL_CHARS
from .service import Service

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ["binary_tensor_data", "classification"]
# Parameters reserved by Triton clients (sent by tritonclient itself): accepted and not acted on.
RESERVED = {"binary_data_output", "timeout", "priority", "sequence_id", "sequence_start", "sequence_end"}


INFER_ROUTES = ("/v2/models/{model}/infer", "/v2/models/{model}/versions/{model_version}/infer")


class KServeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def protocol_error(exc: ApiError | InvalidRequest | DepthError) -> KServeError:
    """The protocol's one error map: the front door's refusals keep their status; the caller's
    mistakes are 400 (the protocol's status for them), too few blocks 503."""
    if isinstance(exc, ApiError):
        return KServeError(exc.status_code, str(exc.detail))
    if isinstance(exc, InvalidRequest):
        return KServeError(400, str(exc))
    return KServeError(503, str(exc))


class InferParameters(BaseModel):
    """Request parameters this server acts on; anything else is refused (a typo must not pass silently)."""

    model_config = ConfigDict(extra="forbid")
    policy: Literal["sequential", "shuffle", "fastest"] | None = None
    seed: int | None = Field(None, ge=0, lt=2**31)
    min_blocks: int | None = Field(None, ge=0, le=1024)
    max_blocks: int | None = Field(None, ge=1, le=1024)
    exit_confidence: float | None = Field(None, gt=0.0, le=1.0)
    resize: bool = False


def mount_kserve(
    app: FastAPI, service: Service, activity: Activity, slots: BodySlots, decoder: Decoder, infer: bool = True
) -> None:
    """The protocol's routes; `infer`: its inference routes too (image families)."""
    settings, manifest = service.settings, service.router.manifest
    cfg = manifest.config
    name = settings.model_dir.name
    version = manifest.model_id
    classes = model_classes(cfg)
    size = cfg.image_size
    # Room for a full batch of encoded images or of binary FP32 tensors; JSON floats take about three
    # times the bytes, so a full batch of large images has to use the binary extension.
    body_limit = 4 * settings.max_upload_bytes + settings.max_batch * 3 * size * size * 4 + 64 * 1024

    @app.exception_handler(KServeError)
    async def _kserve_error(request: Request, exc: KServeError) -> JSONResponse:
        if request.url.path.endswith("/infer"):  # every refused inference, once, on the swarm page
            activity.record_failure("v2", batch_of(request), exc.status, exc.message[:MAX_ERROR_CHARS])
        return JSONResponse(status_code=exc.status, content={"error": exc.message})

    def check_model(model: str, model_version: str | None = None) -> None:
        if model != name or model_version not in (None, "", version):
            known = f"{name} (version {version})"
            raise KServeError(404, f"unknown model {model!r} version {model_version or '-'}; this server has {known}")

    def metadata() -> dict[str, Any]:
        batch = -1
        return {
            "name": name,
            "versions": [version],
            "platform": "layerswarm",
            "inputs": [
                {"name": "images", "datatype": "FP32", "shape": [batch, 3, size, size]},
                {"name": "images_encoded", "datatype": "BYTES", "shape": [batch]},
                {"name": "label", "datatype": "BYTES", "shape": [batch]},
            ],
            "outputs": [
                {"name": "probabilities", "datatype": "FP32", "shape": [batch, len(classes)]},
                {"name": "class_ids", "datatype": "INT64", "shape": [batch]},
                {"name": "labels", "datatype": "BYTES", "shape": [batch]},
            ],
            "parameters": {"family_id": manifest.family_id, "max_batch_size": settings.max_batch},
        }

    @app.get("/v2", tags=["kserve v2"])
    async def server_metadata() -> dict[str, Any]:
        """Server metadata (Open Inference Protocol)."""
        return {"name": "layerswarm", "version": __version__, "extensions": EXTENSIONS}

    @app.get("/v2/health/live", tags=["kserve v2"])
    async def live() -> dict[str, bool]:
        """Liveness: 200 while the process serves."""
        return {"live": True}

    @app.get("/v2/health/ready", tags=["kserve v2"], responses={400: {}})
    async def ready() -> JSONResponse:
        """Readiness: 200 once the minimum depth is reachable, else 400 (the protocol's 4xx for false)."""
        ok, reason = service.ready()
        return JSONResponse(status_code=200 if ok else 400, content={"ready": ok, "detail": reason})

    @app.get("/v2/models", tags=["kserve v2"])
    async def models() -> dict[str, Any]:
        """The models this server has (one)."""
        return {"models": [{"name": name, "versions": [version], "platform": "layerswarm"}]}

    @app.get("/v2/models/{model}", tags=["kserve v2"], responses={404: {}})
    @app.get("/v2/models/{model}/versions/{model_version}", tags=["kserve v2"], responses={404: {}})
    async def model_metadata(model: str, model_version: str | None = None) -> dict[str, Any]:
        """Model metadata: inputs and outputs with datatypes and shapes (-1: the batch dimension)."""
        check_model(model, model_version)
        return metadata()

    @app.get("/v2/models/{model}/ready", tags=["kserve v2"], responses={400: {}, 404: {}})
    @app.get("/v2/models/{model}/versions/{model_version}/ready", tags=["kserve v2"], responses={400: {}, 404: {}})
    async def model_ready(model: str, model_version: str | None = None) -> JSONResponse:
        """Model readiness: as server readiness."""
        check_model(model, model_version)
        ok, reason = service.ready()
        return JSONResponse(status_code=200 if ok else 400, content={"name": name, "ready": ok, "detail": reason})

    if not infer:
        return
    responses: dict[int | str, dict[str, Any]] = {400: {}, 404: {}, 413: {}, 429: {}, 503: {}}

    @app.post(INFER_ROUTES[0], tags=["kserve v2"], responses=responses)
    @app.post(INFER_ROUTES[1], tags=["kserve v2"], responses=responses)
    async def infer_route(model: str, request: Request, model_version: str | None = None) -> Response:
        """Inference: JSON tensors, or the binary tensor extension (Inference-Header-Content-Length)."""
        check_model(model, model_version)
        head = {"model_name": name, "model_version": version}
        return await _serve_infer(request, service, activity, slots, decoder, head, body_limit)


async def _serve_infer(
    request: Request,
    service: Service,
    activity: Activity,
    slots: BodySlots,
    decoder: Decoder,
    head: dict[str, str],
    body_limit: int,
) -> Response:
    """Admission before the body, the body through the front door's reader, the one image decoder;
    every refusal in the protocol's error format."""
    cfg, max_batch = service.router.config, service.settings.max_batch
    classes = model_classes(cfg)
    try:
        async with service.admission.admit():  # 429 from the headers alone, before any body is read
            body = await slots.read_body(request, body_limit)  # streamed under the limit, in a body slot
            parsed = _parse(body, request)
            opts, resize = _options(parsed)
            images, truths = await _images(parsed, decoder, cfg.image_size, resize, max_batch)
            request.state.batch = int(images.shape[0])  # the page counts a failure's items
            result, predictions = await classify_batch(service, activity, images, opts, truths, api="v2")
    except (ApiError, InvalidRequest, DepthError) as exc:
        raise protocol_error(exc) from exc
    probs = result.probs.numpy().astype(np.float32)
    payload, header_length = encode_response(
        {**head, **({"id": parsed.id} if parsed.id else {})}, _outputs(parsed, probs, predictions, classes)
    )
    if header_length is None:
        return Response(payload, media_type="application/json")
    return Response(payload, media_type="application/octet-stream", headers={HEADER_LENGTH: str(header_length)})


def _parse(body: bytes, request: Request) -> InferRequest:
    try:
        return parse_request(body, _header_length(request))
    except ProtocolError as exc:
        raise KServeError(400, str(exc)) from exc


def _header_length(request: Request) -> int | None:
    value = request.headers.get(HEADER_LENGTH)
    if value is None:
        return None
    length = plain_int(value)
    if length is None:
        raise KServeError(400, f"{HEADER_LENGTH} must be a non-negative integer of at most {MAX_INT_DIGITS} digits")
    return length


def _options(parsed: InferRequest) -> tuple[ClassifyOptions, bool]:
    own = {k: v for k, v in parsed.parameters.items() if k not in RESERVED}
    try:
        params = InferParameters.model_validate(own)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise KServeError(400, f"invalid parameters: {problems}") from exc
    return ClassifyOptions.from_fields({**params.model_dump(), "top_k": 1}), params.resize


async def _images(
    parsed: InferRequest, decoder: Decoder, size: int, resize: bool, max_batch: int
) -> tuple[torch.Tensor, list[str | None]]:
    """The batch from `images` or `images_encoded` (exactly one), and the optional true labels."""
    by_name: dict[str, InputTensor] = {}
    for tensor in parsed.inputs:
        if tensor.name not in ("images", "images_encoded", "label"):
            raise KServeError(400, f"unexpected input {tensor.name!r}: expected images, images_encoded, label")
        if tensor.name in by_name:
            raise KServeError(400, f"input {tensor.name!r} given twice")
        by_name[tensor.name] = tensor
    if ("images" in by_name) == ("images_encoded" in by_name):
        raise KServeError(400, "send exactly one of `images` (FP32 [B,3,H,W]) and `images_encoded` (BYTES [B])")
    if "images" in by_name:
        images = _float_images(by_name["images"], size, max_batch)
    else:
        encoded = by_name["images_encoded"]
        if encoded.datatype != "BYTES" or len(encoded.shape) not in (1, 2) or encoded.shape[1:] not in ((), (1,)):
            raise KServeError(400, f"`images_encoded` must be BYTES of shape [B] or [B, 1], got {list(encoded.shape)}")
        _check_batch(len(encoded.items), max_batch)
        images = await decoder.decode_many(encoded.items, resize)  # the one decoder: pixel budget, workers
    truths: list[str | None] = [None] * int(images.shape[0])
    if "label" in by_name:
        label = by_name["label"]
        if label.datatype != "BYTES" or len(label.items) != len(truths):
            raise KServeError(400, f"`label` must be BYTES with one element per image ({len(truths)})")
        given = [item.decode("utf-8", "replace") for item in label.items]
        if any(len(truth) > MAX_LABEL_CHARS for truth in given):
            raise KServeError(400, f"a `label` element is longer than {MAX_LABEL_CHARS} characters")
        truths = list(given)
    return images, truths


def _float_images(tensor: InputTensor, size: int, max_batch: int) -> torch.Tensor:
    expected = [-1, 3, size, size]
    if tensor.datatype != "FP32" or len(tensor.shape) != 4 or list(tensor.shape[1:]) != expected[1:]:
        raise KServeError(400, f"`images` must be FP32 of shape {expected}, got {tensor.datatype} {list(tensor.shape)}")
    _check_batch(tensor.shape[0], max_batch)
    assert tensor.array is not None
    if not np.isfinite(tensor.array).all():
        raise KServeError(400, "`images` contains NaN or infinite values")
    return torch.from_numpy(np.array(tensor.array, dtype=np.float32))  # a copy: the body buffer is read-only


def _check_batch(size: int, max_batch: int) -> None:
    if size == 0:
        raise KServeError(400, "the batch is empty")
    if size > max_batch:
        raise KServeError(413, f"batch of {size} is over the limit of {max_batch}")


def _outputs(
    parsed: InferRequest, probs: np.ndarray, predictions: list[str], classes: tuple[str, ...]
) -> list[tuple[OutputTensor, bool]]:
    batch = probs.shape[0]
    available = {
        "probabilities": OutputTensor("probabilities", "FP32", probs.shape, array=probs),
        "class_ids": OutputTensor("class_ids", "INT64", (batch,), array=probs.argmax(-1).astype(np.int64)),
        "labels": OutputTensor("labels", "BYTES", (batch,), items=[p.encode() for p in predictions]),
    }
    if parsed.outputs is None:
        return [(tensor, parsed.binary_output) for tensor in available.values()]
    chosen = []
    for wanted in parsed.outputs:
        if wanted.name not in available:
            raise KServeError(400, f"unknown output {wanted.name!r}: expected one of {sorted(available)}")
        tensor = available[wanted.name]
        if wanted.classification:
            tensor = _classification(wanted.name, probs, wanted.classification, classes)
        chosen.append((tensor, wanted.binary))
    return chosen


def _classification(name: str, probs: np.ndarray, k: int, classes: tuple[str, ...]) -> OutputTensor:
    """The classification extension: the top k of each item as "score:index:label" strings."""
    k = min(k, probs.shape[1])
    top = np.argsort(-probs, axis=1)[:, :k]
    items = [f"{probs[b, i]:.6f}:{i}:{classes[i]}".encode() for b in range(probs.shape[0]) for i in top[b]]
    return OutputTensor(name, "BYTES", (probs.shape[0], k), items=items)
