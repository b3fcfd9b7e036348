"""The swarm page's traffic bookkeeping: bounded, windowed, accuracy only over labelled items."""

from __future__ import annotations

import torch

from layerswarm.coordinator import Classification, Hop, PathResult, Policy
from layerswarm.coordinator.http.activity import RECENT_REQUESTS, WINDOW_S, Activity
from layerswarm.coordinator.routing.ensemble import EnsembleResult, Route


def result(batch: int = 1, depth_of_first: bool = True) -> Classification:
    """Two blocks run (one substituted) and one skipped, ended by the exit rule; or one block, no exit."""
    hops = [
        Hop(position=0, planned_block=0, block=0, node="n0", model_id="m", latency_ms=1.0),
        Hop(position=1, planned_block=1, block=2, node="n2", model_id="m", latency_ms=2.0, outcome="substituted"),
        Hop(position=1, planned_block=2, outcome="skipped"),
    ]
    if not depth_of_first:
        hops = hops[:1]
    path = PathResult(torch.zeros(batch, 1), hops, unreachable=[3], exited_early=depth_of_first)
    ensemble = EnsembleResult([Route(0, path, torch.zeros(batch, 4))], requested=1, mode="parallel")
    return Classification(torch.zeros(batch, 4), path, Policy.SHUFFLE, seed=1, elapsed_ms=5.0, ensemble=ensemble)


def test_routes_rates_and_accuracy_over_the_window() -> None:
    now = [1000.0]
    activity = Activity(clock=lambda: now[0])
    record = activity.record_success("v1", result(3), ["a", "b", "c"], ["a", "x", None])
    assert (record.correct, record.labelled, record.depth, record.exited_early) == (1, 2, 2, True)
    assert [(s.block, s.outcome) for s in record.route] == [(0, "ok"), (2, "substituted"), (None, "skipped")]
    activity.record_failure("v2", 1, 503, "insufficient_depth")
    stats = activity.stats()
    assert stats["errors"] == 1 and stats["error_rate"] == 0.5 and stats["accuracy"] == 0.5
    # blocks per answered request (the failure ran none and is not counted) and the early exits
    assert stats["mean_blocks"] == 2 and stats["exited_early"] == 1
    activity.record_success("v1", result(depth_of_first=False), ["a"], [None])
    assert activity.stats()["mean_blocks"] == 1.5 and activity.stats()["exited_early"] == 1
    assert stats["requests_per_s"] == round(2 / WINDOW_S, 3) and stats["items_per_s"] == round(4 / WINDOW_S, 3)
    assert [r["api"] for r in activity.routes()] == ["v1", "v2", "v1"]  # newest first
    now[0] += WINDOW_S + 1  # the window moves on; totals stay
    stats = activity.stats()
    assert stats["requests_per_s"] == 0 and stats["accuracy"] is None and stats["error_rate"] is None
    assert stats["mean_blocks"] is None and stats["exited_early"] == 0
    assert stats["totals"]["requests"] == 3 and stats["total_accuracy"] == 0.5
    assert (stats["totals"]["answered"], stats["totals"]["blocks"], stats["totals"]["exited_early"]) == (2, 3, 1)


def test_memory_is_bounded() -> None:
    now = [0.0]
    activity = Activity(clock=lambda: now[0])
    for i in range(RECENT_REQUESTS * 3):
        now[0] = float(i)
        activity.record_success("v1", result(), ["a"], [None])
    assert len(activity.recent) == RECENT_REQUESTS and len(activity._buckets) <= WINDOW_S + 1
    assert activity.routes(5)[0]["seq"] == RECENT_REQUESTS * 3
