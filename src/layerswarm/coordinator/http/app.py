"""The coordinator's HTTP API (FastAPI): classify, the swarm view, probes, metrics.

Every error is JSON {"error": code, "detail": reason} with a 4xx status (503 when the swarm is too
thin to answer); nothing reaches a client as a traceback. Requests are read in http_requests.py,
answers built in http_responses.py; the KServe v2 protocol, the page and text mount their own routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from layerswarm import __version__

from ..process import Coordinator
from .access_log import AccessLog
from .activity import Activity
from .admission import Gate
from .api_keys import ApiKeys
from .classify import classify_options, run_classification
from .errors import ApiError, describe, error_response
from .front_door import FrontDoor
from .imaging import Decoder
from .kserve import mount_kserve
from .page import mount_page
from .reading import read_batch, read_classify
from .responses import batch_response, classify_response
from .schemas import BATCH_BODY, CLASSIFY_BODY, BatchResponse, ClassifyResponse
from .text import mount_text

CLASSIFY_ERRORS: dict[int | str, dict[str, Any]] = {c: {} for c in (400, 413, 415, 422, 429, 503)}


def create_app(coordinator: Coordinator) -> FastAPI:
    settings = coordinator.settings
    activity = Activity()  # recent requests and rates, for the swarm page
    # Swagger UI and ReDoc assets come from the installed package, not a CDN: /docs works offline.
    app = FastAPIOffline(
        title="layerswarm coordinator",
        version=__version__,
        description="Classify images through a swarm of block nodes, in any order.",
    )
    install_error_handlers(app, activity)
    # Outermost: the access log and request ids, then API keys, every status counted, quiet disconnects,
    # bugs answered as JSON 500.
    app.add_middleware(FrontDoor, keys=ApiKeys(settings.api_keys), metrics=coordinator.metrics)
    app.add_middleware(AccessLog, enabled=settings.access_log)
    gate = Gate(settings.max_concurrent_requests, settings.max_body_reads, coordinator.metrics)
    decoder = Decoder(coordinator.config.image_size, settings.max_image_pixels, coordinator.metrics.decoding)
    app.state.gate, app.state.decoder = gate, decoder  # server.py closes the decoder's threads
    mount_classify(app, coordinator, activity, gate, decoder)
    mount_ops(app, coordinator)
    mount_kserve(app, coordinator, activity)
    mount_page(app, coordinator, activity)
    mount_text(app, coordinator, activity, gate)  # POST /v1/classify/text (coordinator/http_text.py)
    return app


def install_error_handlers(app: FastAPI, activity: Activity) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if request.url.path.startswith("/v1/classify"):
            activity.record_rejection("v1", exc.status_code, exc.error)
        return error_response(exc.status_code, exc.error, exc.detail)

    @app.exception_handler(StarletteHTTPException)  # routing 404/405 come from Starlette itself
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, "http_error", exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", describe(exc.errors()))


def mount_classify(app: FastAPI, coordinator: Coordinator, activity: Activity, gate: Gate, decoder: Decoder) -> None:
    settings, classes = coordinator.settings, coordinator.config.class_names

    @app.post("/v1/classify", response_model=ClassifyResponse, openapi_extra=CLASSIFY_BODY, responses=CLASSIFY_ERRORS)
    async def classify(request: Request) -> ClassifyResponse:
        """Classify one image: upload it as multipart `file`, or POST JSON with `image_base64`."""
        async with gate.admit():  # 429 from the headers alone, before any body is read
            image, params = await read_classify(gate, request, settings.max_upload_bytes)
            images = await decoder.to_batch(image, params.resize)  # pixel budget, then a worker
            result = await run_classification(coordinator, activity, images, classify_options(params), [params.label])
        return classify_response(result, classes, params.top_k)

    @app.post("/v1/classify/batch", response_model=BatchResponse, openapi_extra=BATCH_BODY, responses=CLASSIFY_ERRORS)
    async def classify_many(request: Request) -> BatchResponse:
        """Classify several images as one batch (one path through the swarm, one call per hop): upload
        several multipart `file` parts (optional `label` fields, one per file), or POST JSON with `images`."""
        async with gate.admit():
            blobs, truths, params = await read_batch(gate, request, settings.max_upload_bytes, settings.max_batch)
            images = await decoder.decode_many(blobs, params.resize)
            result = await run_classification(coordinator, activity, images, classify_options(params), truths)
        return batch_response(result, classes, params.top_k)


def mount_ops(app: FastAPI, coordinator: Coordinator) -> None:
    """What operators and orchestrators read: the swarm, liveness, readiness, metrics."""
    cfg = coordinator.config

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
