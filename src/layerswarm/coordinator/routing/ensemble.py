"""Path ensembles: k routes through the swarm, logits averaged. Routes go over other family members
(their stem, nodes and head; `over="members"`, the default where the coordinator holds several) or
over other random orders of one model (`over="orders"`).

`parallel` runs the k routes at once. `adaptive` runs one route and starts another only while the
answer so far is unsure (top-class probability of the mean logits below a threshold: the exit rule in
reverse), so easy inputs pay for one route. A route that fails (too few blocks ran) is reported in
the response, never dropped silently; the request fails only when every route failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from .trace import DepthError, PathResult

log = logging.getLogger(__name__)

MODES = ("parallel", "adaptive")
OVER = ("members", "orders")


@dataclass
class Route:
    index: int
    path: PathResult
    logits: torch.Tensor  # (B, classes)
    model_id: str | None = None  # the member whose stem and head this route used (members.py)


@dataclass
class EnsembleResult:
    routes: list[Route]
    requested: int
    mode: str
    failed: list[str] = field(default_factory=list)  # why routes that were started did not count

    @property
    def logits(self) -> torch.Tensor:
        return torch.stack([r.logits for r in self.routes]).mean(0)


RouteFn = Callable[[int], Awaitable[Route]]


async def run_ensemble(route: RouteFn, k: int, mode: str, unsure_below: float) -> EnsembleResult:
    if k <= 1:
        return EnsembleResult([await route(0)], 1, mode)
    if mode == "parallel":
        outcomes = await asyncio.gather(*(route(i) for i in range(k)), return_exceptions=True)
        return _collect(list(outcomes), k, mode)
    first = await route(0)
    result = EnsembleResult([first], k, mode)
    while len(result.routes) + len(result.failed) < k and _unsure(result.logits, unsure_below):
        try:
            result.routes.append(await route(len(result.routes) + len(result.failed)))
        except DepthError as exc:
            result.failed.append(str(exc))
    return result


def _unsure(logits: torch.Tensor, threshold: float) -> bool:
    return bool((logits.softmax(-1).max(-1).values < threshold).any())


def _collect(outcomes: list[Route | BaseException], k: int, mode: str) -> EnsembleResult:
    routes = [o for o in outcomes if isinstance(o, Route)]
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    for error in errors:
        if not isinstance(error, DepthError):
            raise error
    if not routes:
        raise errors[0]
    return EnsembleResult(routes, k, mode, [str(e) for e in errors])
