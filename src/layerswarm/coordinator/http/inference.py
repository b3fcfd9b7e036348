"""One classification as every HTTP API runs it: the caller's labels checked, the latency measured,
the answer drawn on the swarm page.

The native API (/v1: images, batches, text) and the Open Inference Protocol (/v2) all call
`classify_batch` once admitted (admission.py), so a batch is counted and drawn the same way whichever
protocol brought it. Its failures (InvalidRequest, DepthError) are each API's to answer, in its own
format, from its one error map (errors.py, kserve.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerswarm.models.config import ViTConfig

from ..routing.request import ClassifyOptions, InvalidRequest
from ..routing.router import Classification
from .activity import Activity
from .bodies import plain_int
from .service import Service


def model_classes(config: ViTConfig) -> tuple[str, ...]:
    """The model's class names (a model saved without names: its class indices as text)."""
    return tuple(config.class_names) or tuple(str(i) for i in range(config.num_classes))


def predicted_labels(result: Classification, class_names: Sequence[str]) -> list[str]:
    """The top-1 label of each item of the batch."""
    indices = result.probs.argmax(-1).tolist()
    return [class_names[i] if i < len(class_names) else str(i) for i in indices]


async def classify_batch(
    service: Service,
    activity: Activity,
    inputs: torch.Tensor,
    options: ClassifyOptions,
    truths: Sequence[str | None] = (),
    api: str = "v1",
) -> tuple[Classification, list[str]]:
    """Run `inputs` (B, C, H, W) images or (B, T) token ids through the swarm as ONE batch per hop;
    returns the result and each item's predicted label. `truths` (labels the client says are right)
    feed the page's accuracy. Raises InvalidRequest (an unknown label, options no node could serve)
    and DepthError (too few blocks)."""
    router = service.router
    names = model_classes(router.config)
    truths = [_class_name(t, names) for t in truths]
    unknown = next((t for t in truths if t is not None and t not in names), None)
    if unknown is not None:  # a typo would count as a wrong answer on the page, silently
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        last = len(names) - 1
        raise InvalidRequest(f"label {unknown[:64]!r} is neither a class of the model ({shown}) nor an index 0-{last}")
    with service.metrics.latency.time():
        result = await router.classify(inputs, options)
    predictions = predicted_labels(result, names)
    activity.record_success(api, result, predictions, truths or [None] * int(inputs.shape[0]))
    return result, predictions


def _class_name(truth: str | None, names: Sequence[str]) -> str | None:
    """A true label as a class name: clients may send the name or the class index."""
    index = None if truth is None else plain_int(truth)  # a client's text: "²" and 5,000 digits included
    return names[index] if index is not None and index < len(names) else truth
