"""POST /v1/classify/text: classify a text through a text family's swarm (same options, traces and
errors as /v1/classify for images; mounted only for text families: app.py).

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

from ..routing.request import ClassifyOptions
from .activity import Activity
from .bodies import BodySlots, read_json_object
from .errors import ApiError, describe
from .inference import classify_batch
from .reading import JSON, content_type_of
from .responses import classify_response
from .schemas import ClassifyParams, ClassifyResponse
from .service import Service

MAX_TEXT_CHARS = 100_000  # far past any family's token limit: a bound on tokenizer work, not the rule
TEXT_ROUTES = ("/v1/classify/text",)


def mount_text(app: FastAPI, service: Service, activity: Activity, slots: BodySlots) -> None:

    class TextClassifyJson(ClassifyParams):
        text: str = Field(..., max_length=MAX_TEXT_CHARS, description="the text to classify")
        token_depth: Literal["full", "mi", "reconstruction"] = Field(
            "full", description="per-token depth: full, or the model's mutual-information / reconstruction estimate"
        )

    settings, admission, manifest = service.settings, service.admission, service.router.manifest
    cfg = manifest.config
    tokenizer = load_tokenizer(verified_file(settings.model_dir, manifest, TOKENIZER))

    @app.post(
        "/v1/classify/text", response_model=ClassifyResponse, responses={400: {}, 413: {}, 422: {}, 429: {}, 503: {}}
    )
    async def classify_text(request: Request) -> ClassifyResponse:
        """Classify one text: JSON {"text": "...", ...options of /v1/classify, "token_depth": "mi"}."""
        content_type_of(request, "text", accept=(JSON,))  # 415 before the body is read
        async with admission.admit():
            body = await read_json_object(slots, request, settings.max_upload_bytes)
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
            request.state.batch = 1  # the page counts a failure's items
            result, _ = await classify_batch(service, activity, ids, _options(params, depth), [params.label])
        return classify_response(result, cfg.class_names, params.top_k)


def _options(params: ClassifyParams, depth: torch.Tensor | None) -> ClassifyOptions:
    """The request's options, with per-token depth: `token_depth` here is the body's choice of table
    (full, mi, reconstruction), the options' is the table's depths for these tokens."""
    opts = ClassifyOptions.from_fields(params.model_dump(exclude={"token_depth"}))
    if depth is None:
        return opts
    deepest = int(depth.max())  # the path ends once every token froze
    max_blocks = deepest if params.max_blocks is None else min(params.max_blocks, deepest)
    min_blocks = max_blocks if params.min_blocks is None else params.min_blocks
    return replace(opts, max_blocks=max_blocks, min_blocks=min_blocks, token_depth=depth)
