"""POST /v1/classify/text: classify a text through a text family's swarm (same options, traces and
errors as /v1/classify for images; registered by http_api.create_app with one line).

Per-token depth: `"token_depth": "mi"` or `"reconstruction"` gives each word the number of hops it runs
before it freezes (the tables `layerswarm depth` wrote into the model directory's policy); the
[CLS] token runs as deep as the deepest word, and the path stops there. Default "full": every token
runs every hop.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from pydantic import Field, ValidationError

from layerswarm.models.checkpoint import TOKENIZER, verified_file
from layerswarm.models.text.depth import DEPTH_POLICY, token_depths
from layerswarm.models.text.tokenizer import TextInputError, encode_one, load_tokenizer

from .activity import Activity
from .bodies import read_json_object
from .core import ClassifyOptions, Coordinator
from .exits import ExitRuleError
from .http_errors import ApiError, describe
from .http_models import ClassifyParams, ClassifyResponse
from .http_responses import classify_response
from .limits import Gate
from .planner import Policy
from .serving import Busy, TooThin, classify_batch

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
            opts = _options(params, depth)
            try:
                result, _ = await classify_batch(coordinator, activity, ids, opts, [params.label])
            except ExitRuleError as exc:
                raise ApiError(422, "invalid_request", str(exc)) from exc
            except Busy as exc:
                raise ApiError(429, "busy", str(exc)) from exc
            except TooThin as exc:
                raise ApiError(503, "insufficient_depth", str(exc)) from exc
        return classify_response(result, cfg.class_names, params.top_k)


async def _wrong_family() -> None:
    detail = 'this coordinator serves a text family: POST JSON {"text": ...} to /v1/classify/text'
    raise ApiError(400, "wrong_family", detail)


def _options(params: Any, depth: torch.Tensor | None) -> ClassifyOptions:
    max_blocks = params.max_blocks
    if depth is not None:  # the path ends once every token froze
        deepest = int(depth.max())
        max_blocks = deepest if max_blocks is None else min(max_blocks, deepest)
    return ClassifyOptions(
        top_k=params.top_k,
        policy=Policy(params.policy) if params.policy else None,
        seed=params.seed,
        min_blocks=params.min_blocks if depth is None or params.min_blocks is not None else max_blocks,
        max_blocks=max_blocks,
        exit_confidence=params.exit_confidence,
        exit_rule=params.exit_rule,
        exit_threshold=params.exit_threshold,
        deadline_ms=params.deadline_ms,
        ensemble=params.ensemble,
        ensemble_mode=params.ensemble_mode,
        ensemble_confidence=params.ensemble_confidence,
        repeats=params.repeats,
        token_depth=depth,
    )
