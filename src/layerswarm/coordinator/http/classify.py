"""One classification behind any HTTP route: the request's options as ClassifyOptions, and the serving
layer's refusals as HTTP errors (422 bad exit rule, 429 busy, 503 too thin)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..process import Classification, ClassifyOptions, Coordinator
from ..routing.exits import ExitRuleError
from ..routing.planner import Policy
from ..routing.request import InvalidRequest
from .activity import Activity
from .errors import ApiError
from .inference import Busy, TooThin, classify_batch
from .schemas import ClassifyParams


def classify_options(params: ClassifyParams) -> ClassifyOptions:
    return ClassifyOptions(
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
        ensemble_over=params.ensemble_over,
        repeats=params.repeats,
    )


async def run_classification(
    coordinator: Coordinator,
    activity: Activity,
    images: torch.Tensor,
    opts: ClassifyOptions,
    truths: Sequence[str | None],
) -> Classification:
    """Through the serving layer (admission, activity); its refusals as HTTP errors."""
    try:
        result, _ = await classify_batch(coordinator, activity, images, opts, truths)
    except (ExitRuleError, InvalidRequest) as exc:  # e.g. an exit rule out of range, min_blocks past the depth
        raise ApiError(422, "invalid_request", str(exc)) from exc
    except Busy as exc:
        raise ApiError(429, "busy", str(exc)) from exc
    except TooThin as exc:
        raise ApiError(503, "insufficient_depth", str(exc)) from exc
    return result
