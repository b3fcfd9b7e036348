"""One classification as every HTTP API runs it: admission, metrics, the page's activity log.

The native API (/v1) and the Open Inference Protocol (/v2) both call `classify_batch`, so a batch is
admitted, counted and drawn on the swarm page the same way whichever protocol brought it. Each API
turns the two failures below into its own error format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..process import Classification, ClassifyOptions, Coordinator
from ..routing.request import InvalidRequest
from ..routing.trace import DepthError
from .activity import Activity
from .bodies import plain_int


class Busy(Exception):
    """Too many requests in flight: the client should retry shortly (429)."""


class TooThin(Exception):
    """Fewer blocks could run than the request's minimum (503)."""


def model_classes(config: Any) -> tuple[str, ...]:
    """The model's class names (a model saved without names: its class indices as text)."""
    return tuple(config.class_names) or tuple(str(i) for i in range(config.num_classes))


def predicted_labels(result: Classification, class_names: Sequence[str]) -> list[str]:
    """The top-1 label of each item of the batch."""
    indices = result.probs.argmax(-1).tolist()
    return [class_names[i] if i < len(class_names) else str(i) for i in indices]


async def classify_batch(
    coordinator: Coordinator,
    activity: Activity,
    images: torch.Tensor,
    opts: ClassifyOptions,
    truths: Sequence[str | None] = (),
    api: str = "v1",
) -> tuple[Classification, list[str]]:
    """Run `images` (B, C, H, W) through the swarm as ONE batch per hop; returns the result and each
    item's predicted label. `truths` (labels the client says are right) feed the page's accuracy."""
    settings = coordinator.settings
    batch = int(images.shape[0])
    names = model_classes(coordinator.config)
    truths = [_class_name(t, names) for t in truths]
    unknown = next((t for t in truths if t is not None and t not in names), None)
    if unknown is not None:  # a typo would count as a wrong answer on the page, silently
        activity.record_failure(api, batch, 422 if api == "v1" else 400, "invalid_request")
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        last = len(names) - 1
        raise InvalidRequest(f"label {unknown[:64]!r} is neither a class of the model ({shown}) nor an index 0-{last}")
    if coordinator.in_flight >= settings.max_concurrent_requests:
        activity.record_failure(api, batch, 429, "busy")
        raise Busy(f"{coordinator.in_flight} requests in flight; retry shortly")
    coordinator.begin_request()
    try:
        with coordinator.metrics.latency.time():
            result = await coordinator.classify(images, opts)
    except DepthError as exc:
        activity.record_failure(api, batch, 503, "insufficient_depth")
        raise TooThin(str(exc)) from exc
    except InvalidRequest:
        activity.record_failure(api, batch, 422 if api == "v1" else 400, "invalid_request")
        raise
    finally:
        coordinator.end_request()
    predictions = predicted_labels(result, names)
    activity.record_success(api, result, predictions, truths or [None] * batch)
    return result, predictions


def _class_name(truth: str | None, names: Sequence[str]) -> str | None:
    """A true label as a class name: clients may send the name or the class index."""
    index = None if truth is None else plain_int(truth)  # a client's text: "²" and 5,000 digits included
    return names[index] if index is not None and index < len(names) else truth
