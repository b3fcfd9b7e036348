"""POST /v1/classify/text: classify a text through a text family's swarm (same options, traces and
errors as /v1/classify for images; registered by http_api.create_app with one line).

Per-token depth: `"token_depth": "mi"` or `"reconstruction"` gives each word the number of hops it runs
before it freezes (the tables `layerswarm depth` wrote into the model directory's policy); the
[CLS] runs the full depth (the head reads it). Default "full": every token
runs every hop.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from fastapi import FastAPI, Request
from pydantic import Field, ValidationError

from layerswarm.models.checkpoint import TOKENIZER, verified_file
from layerswarm.models.text.depth import DEPTH_POLICY, token_depths
from layerswarm.models.text.tokenizer import TextInputError, encode_one, load_tokenizer

from ..process import ClassifyOptions, Coordinator
from .activity import Activity
from .admission import Gate
from .bodies import read_json_object
from .classify import classify_options, run_classification
from .errors import ApiError, describe
from .reading import JSON, content_type_of
from .responses import classify_response
from .schemas import ClassifyParams, ClassifyResponse

MAX_TEXT_CHARS = 100_000  # far past any family's token limit: a bound on tokenizer work, not the rule
IMAGE_ROUTES = (  # routes that take images: a text family answers them 400 wrong_family
    "/v1/classify",
    "/v1/classify/batch",
    "/v2/models/{model}/infer",
    "/v2/models/{model}/versions/{model_version}/infer",
)


def mount_text(app: FastAPI, coordinator: Coordinator, activity: Activity, gate: Gate) -> None:

    class TextClassifyJson(ClassifyParams):
        text: str = Field(..., max_length=MAX_TEXT_CHARS, description="the text to classify")
        token_depth: Literal["full", "mi", "reconstruction"] = Field(
            "full", description="per-token depth: full, or the model's mutual-information / reconstruction estimate"
        )

    cfg = coordinator.config
    manifest = coordinator.manifest
    tokenizer = (
        load_tokenizer(verified_file(coordinator.settings.model_dir, manifest, TOKENIZER)) if cfg.is_text else None
    )

    if cfg.is_text:  # the image routes answer a clear 400 (behind the API keys, like every route)
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in IMAGE_ROUTES]
        for path in IMAGE_ROUTES:
            app.add_api_route(path, _wrong_family, methods=["POST"], include_in_schema=False)

    @app.post(
        "/v1/classify/text", response_model=ClassifyResponse, responses={400: {}, 413: {}, 422: {}, 429: {}, 503: {}}
    )
    async def classify_text(request: Request) -> ClassifyResponse:
        """Classify one text: JSON {"text": "...", ...options of /v1/classify, "token_depth": "mi"}."""
        if tokenizer is None:
            raise ApiError(400, "wrong_family", "this coordinator serves an image family: use /v1/classify")
        content_type_of(request, "text", accept=(JSON,))  # 415 before the body is read
        async with gate.admit():
            body = await read_json_object(gate, request, coordinator.settings.max_upload_bytes)
            try:
                params = TextClassifyJson.model_validate(body)
            except ValidationError as exc:
                raise ApiError(422, "invalid_request", describe(exc.errors())) from exc
            try:
                ids = torch.tensor([encode_one(tokenizer, params.text, cfg.max_tokens)])
            except TextInputError as exc:
                status, error = (413, "text_too_long") if "at most" in str(exc) else (422, "empty_text")
                raise ApiError(status, error, str(exc)) from exc
            depth = None
            if params.token_depth != "full":
                try:
                    depth = token_depths(manifest.policy.get(DEPTH_POLICY), params.token_depth, ids)
                except ValueError as exc:
                    raise ApiError(422, "no_token_depth", str(exc)) from exc
            result = await run_classification(coordinator, activity, ids, _options(params, depth), [params.label])
        return classify_response(result, cfg.class_names, params.top_k)


async def _wrong_family() -> None:
    detail = 'this coordinator serves a text family: POST JSON {"text": ...} to /v1/classify/text'
    raise ApiError(400, "wrong_family", detail)


def _options(params: ClassifyParams, depth: torch.Tensor | None) -> ClassifyOptions:
    opts = classify_options(params)
    if depth is None:
        return opts
    deepest = int(depth.max())  # the path ends once every token froze
    max_blocks = deepest if params.max_blocks is None else min(params.max_blocks, deepest)
    min_blocks = max_blocks if params.min_blocks is None else params.min_blocks
    return replace(opts, max_blocks=max_blocks, min_blocks=min_blocks, token_depth=depth)
