"""Classification results as HTTP responses: top labels, the trace (hops, substitutions, skips, exits,
ensemble routes)."""

from __future__ import annotations

from typing import Any

import torch

from ..routing.router import Classification
from ..routing.trace import PathResult
from .schemas import BatchResponse, ClassifyResponse, ItemResult, Label


def top_labels(probs: torch.Tensor, class_names: tuple[str, ...], top_k: int) -> list[Label]:
    values, indices = probs.topk(min(top_k, probs.numel()))
    names = class_names or tuple(str(i) for i in range(probs.numel()))
    return [
        Label(index=int(i), label=names[int(i)], probability=round(float(p), 6))
        for p, i in zip(values, indices, strict=True)
    ]


def trace_of(path: PathResult, result: Classification | None = None) -> dict[str, Any]:
    return {
        "hops": [h.to_json() for h in path.hops],
        "unreachable_blocks": path.unreachable,
        "substituted": sum(h.outcome == "substituted" for h in path.hops),
        "skipped": sum(h.outcome == "skipped" for h in path.hops),
        **({"discarded": [h.to_json() for h in path.discarded]} if path.discarded else {}),
        **path.topology_trace(),
        **(_adaptive_trace(result) if result is not None else {}),
    }


def classify_response(result: Classification, class_names: tuple[str, ...], top_k: int) -> ClassifyResponse:
    labels = top_labels(result.probs[0], class_names, top_k)
    return ClassifyResponse(
        prediction=labels[0].label,
        labels=labels,
        policy=result.policy.value,
        seed=result.seed,
        depth=result.path.depth,
        exited_early=result.path.exited_early,
        exit_rule=result.exit_rule,
        anytime=any(r.path.anytime for r in result.ensemble.routes),
        routes=len(result.ensemble.routes),
        blocks=sum(r.path.depth for r in result.ensemble.routes),
        elapsed_ms=round(result.elapsed_ms, 3),
        trace=trace_of(result.path, result),
    )


def batch_response(result: Classification, class_names: tuple[str, ...], top_k: int) -> BatchResponse:
    results = []
    for probs in result.probs:
        labels = top_labels(probs, class_names, top_k)
        results.append(ItemResult(prediction=labels[0].label, labels=labels))
    return BatchResponse(
        results=results,
        policy=result.policy.value,
        seed=result.seed,
        depth=result.path.depth,
        exited_early=result.path.exited_early,
        elapsed_ms=round(result.elapsed_ms, 3),
        trace=trace_of(result.path),
    )


def _adaptive_trace(result: Classification) -> dict[str, Any]:
    """Early exit, anytime and ensemble routes in the trace (the first route's hops are `hops`)."""
    ensemble = result.ensemble
    return {
        "exit": {"rule": result.exit_rule, "depth": result.path.depth} if result.exit_rule else None,
        "anytime": any(r.path.anytime for r in ensemble.routes),
        "ensemble": {
            "requested": ensemble.requested,
            "mode": ensemble.mode,
            "routes": [
                {
                    "depth": r.path.depth,
                    "exited_early": r.path.exited_early,
                    "anytime": r.path.anytime,
                    "model_id": r.model_id,
                }
                for r in ensemble.routes
            ],
            "extra_route_hops": [[h.to_json() for h in r.path.hops] for r in ensemble.routes[1:]],
            "failed": ensemble.failed,
        },
    }
