"""POST /v1/classify and /v1/classify/batch: images through an image family's swarm (mounted only for
image families: app.py). Bodies are read in reading.py, answers built in responses.py; failures go to
the native API's error map (errors.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from ..routing.request import ClassifyOptions
from .activity import Activity
from .bodies import BodySlots
from .imaging import Decoder
from .inference import classify_batch
from .reading import read_batch, read_classify
from .responses import batch_response, classify_response
from .schemas import BATCH_BODY, CLASSIFY_BODY, BatchResponse, ClassifyResponse
from .service import Service

CLASSIFY_ERRORS: dict[int | str, dict[str, Any]] = {c: {} for c in (400, 413, 415, 422, 429, 503)}
IMAGE_ROUTES = ("/v1/classify", "/v1/classify/batch")


def mount_images(app: FastAPI, service: Service, activity: Activity, slots: BodySlots, decoder: Decoder) -> None:
    settings, admission, classes = service.settings, service.admission, service.router.config.class_names

    @app.post("/v1/classify", response_model=ClassifyResponse, openapi_extra=CLASSIFY_BODY, responses=CLASSIFY_ERRORS)
    async def classify(request: Request) -> ClassifyResponse:
        """Classify one image: upload it as multipart `file`, or POST JSON with `image_base64`."""
        async with admission.admit():  # 429 from the headers alone, before any body is read
            image, params = await read_classify(slots, request, settings.max_upload_bytes)
            images = await decoder.to_batch(image, params.resize)  # pixel budget, then a worker
            request.state.batch = 1  # the page counts a failure's items
            options = ClassifyOptions.from_fields(params.model_dump())
            result, _ = await classify_batch(service, activity, images, options, [params.label])
        return classify_response(result, classes, params.top_k)

    @app.post("/v1/classify/batch", response_model=BatchResponse, openapi_extra=BATCH_BODY, responses=CLASSIFY_ERRORS)
    async def classify_many(request: Request) -> BatchResponse:
        """Classify several images as one batch (one path through the swarm, one call per hop): upload
        several multipart `file` parts (optional `label` fields, one per file), or POST JSON with `images`."""
        async with admission.admit():
            blobs, truths, params = await read_batch(slots, request, settings.max_upload_bytes, settings.max_batch)
            images = await decoder.decode_many(blobs, params.resize)
            request.state.batch = len(blobs)
            options = ClassifyOptions.from_fields(params.model_dump())
            result, _ = await classify_batch(service, activity, images, options, truths)
        return batch_response(result, classes, params.top_k)
