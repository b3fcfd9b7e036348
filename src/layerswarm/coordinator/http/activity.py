"""What the swarm page shows about traffic: recent requests as routes, request rate, errors, accuracy,
and the blocks answered requests ran (early exit: how many stopped before the last block).

Bounded in memory (a ring of recent requests, a ring of one-second buckets); pure bookkeeping with an
injectable clock, filled by the HTTP layers: each answer once, successes by inference.py, failures by each
API's error map (errors.py, kserve.py).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from ..routing.router import Classification

RECENT_REQUESTS = 40  # routes kept for the page
WINDOW_S = 60  # the rate, error and accuracy window
MAX_ERROR_CHARS = 160  # of an error message kept for the page


@dataclass(frozen=True)
class RouteStep:
    """One hop as the page draws it."""

    planned_block: int
    block: int | None  # None: skipped
    node: str | None
    model_id: str | None
    outcome: str  # ok | hedged | substituted | skipped
    latency_ms: float


@dataclass(frozen=True)
class RequestRecord:
    seq: int
    at: float  # wall-clock seconds (for the page's clock)
    api: str  # "v1" or "v2" (KServe)
    batch: int
    status: int  # HTTP status answered
    error: str | None
    policy: str | None
    topology: str | None  # star or relay: how this request's route ran
    depth: int
    exited_early: bool
    elapsed_ms: float
    predictions: tuple[str, ...]
    correct: int  # items whose prediction matched the label they came with
    labelled: int  # items that came with a label
    route: tuple[RouteStep, ...]
    unreachable_blocks: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class TotalsView(TypedDict):
    requests: int
    items: int
    errors: int
    correct: int
    labelled: int
    answered: int
    blocks: int
    exited_early: int


class TrafficStats(TypedDict):
    """The page's traffic figures: rates over the last WINDOW_S seconds, and totals since start."""

    window_s: int
    requests_per_s: float
    items_per_s: float
    errors: int
    error_rate: float | None
    accuracy: float | None
    labelled: int
    mean_blocks: float | None  # blocks run per answered request (the first route's), over the window
    exited_early: int  # answered requests the exit rule stopped before the last block, over the window
    totals: TotalsView
    total_accuracy: float | None


@dataclass
class Totals:
    requests: int = 0
    items: int = 0
    errors: int = 0
    correct: int = 0
    labelled: int = 0
    answered: int = 0  # requests answered 200
    blocks: int = 0  # blocks the answered ones ran
    exited_early: int = 0


@dataclass
class _Bucket(Totals):
    """The counts of one second (the page's rates are sums over the last WINDOW_S buckets)."""

    second: int = 0


@dataclass
class Activity:
    clock: Callable[[], float] = time.time
    recent: deque[RequestRecord] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    totals: Totals = field(default_factory=Totals)
    _buckets: deque[_Bucket] = field(default_factory=lambda: deque(maxlen=WINDOW_S + 1))
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def record_success(
        self, api: str, result: Classification, predictions: Sequence[str], truths: Sequence[str | None]
    ) -> RequestRecord:
        labelled = [(p, t) for p, t in zip(predictions, truths, strict=False) if t is not None]
        path = result.path
        route = tuple(
            RouteStep(h.planned_block, h.block, h.node, h.model_id, h.outcome, round(h.latency_ms, 3))
            for h in path.hops
        )
        record = RequestRecord(
            seq=next(self._seq),
            at=self.clock(),
            api=api,
            batch=len(predictions),
            status=200,
            error=None,
            policy=result.policy.value,
            topology=path.topology,
            depth=path.depth,
            exited_early=path.exited_early,
            elapsed_ms=round(result.elapsed_ms, 3),
            predictions=tuple(predictions),
            correct=sum(p == t for p, t in labelled),
            labelled=len(labelled),
            route=route,
            unreachable_blocks=tuple(path.unreachable),
        )
        return self._add(record)

    def record_failure(self, api: str, batch: int, status: int, error: str) -> RequestRecord:
        """A request that got an error answer: counted as an error, drawn in red on the page."""
        record = RequestRecord(
            seq=next(self._seq),
            at=self.clock(),
            api=api,
            batch=batch,
            status=status,
            error=error,
            policy=None,
            topology=None,
            depth=0,
            exited_early=False,
            elapsed_ms=0.0,
            predictions=(),
            correct=0,
            labelled=0,
            route=(),
            unreachable_blocks=(),
        )
        return self._add(record)

    def _add(self, record: RequestRecord) -> RequestRecord:
        self.recent.append(record)
        bucket = self._bucket(int(record.at))
        failed = record.status >= 400
        for tally in (bucket, self.totals):
            tally.requests += 1
            tally.items += record.batch
            tally.errors += failed
            tally.correct += record.correct
            tally.labelled += record.labelled
            tally.answered += not failed
            tally.blocks += record.depth
            tally.exited_early += record.exited_early
        return record

    def _bucket(self, second: int) -> _Bucket:
        if not self._buckets or self._buckets[-1].second != second:
            self._buckets.append(_Bucket(second=second))
        return self._buckets[-1]

    def stats(self) -> TrafficStats:
        """Rates over the last WINDOW_S seconds, and totals since start."""
        now = int(self.clock())
        window = [b for b in self._buckets if now - b.second < WINDOW_S]
        requests = sum(b.requests for b in window)
        labelled = sum(b.labelled for b in window)
        answered = sum(b.answered for b in window)
        totals = self.totals
        return {
            "window_s": WINDOW_S,
            "requests_per_s": round(requests / WINDOW_S, 3),
            "items_per_s": round(sum(b.items for b in window) / WINDOW_S, 3),
            "errors": sum(b.errors for b in window),
            "error_rate": round(sum(b.errors for b in window) / requests, 4) if requests else None,
            "accuracy": round(sum(b.correct for b in window) / labelled, 4) if labelled else None,
            "labelled": labelled,
            "mean_blocks": round(sum(b.blocks for b in window) / answered, 3) if answered else None,
            "exited_early": sum(b.exited_early for b in window),
            "totals": {
                "requests": totals.requests,
                "items": totals.items,
                "errors": totals.errors,
                "correct": totals.correct,
                "labelled": totals.labelled,
                "answered": totals.answered,
                "blocks": totals.blocks,
                "exited_early": totals.exited_early,
            },
            "total_accuracy": round(totals.correct / totals.labelled, 4) if totals.labelled else None,
        }

    def routes(self, limit: int = RECENT_REQUESTS) -> list[dict[str, Any]]:
        """The most recent requests, newest first."""
        return [r.to_json() for r in list(self.recent)[::-1][:limit]]
