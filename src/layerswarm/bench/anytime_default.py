"""Anytime answers as a user gets them (issue 42): each shipped family through a live swarm with default
options, a request setting only `deadline_ms`, swept over deadlines.

Per family, its first LayerShuffle member's nodes (one per block, loopback, static peers) and an in-process
coordinator with default settings, so the exit rule and the anytime floor (the fewest blocks an answer cut
by a deadline keeps) come from the member's adaptive.json. First the full path's batch-1 latency
(`exit_rule=none`, no deadline) on the warm-up requests; then, for each deadline as a fraction of that p50,
the same held-out requests (the same seeds, so the same block orders) with only `deadline_ms` set, and once
with no deadline (the reference: default options, early exits only): accuracy,
mean blocks, the share cut by the deadline (`anytime`), the share answered within it and latency. The
deadline rows are interleaved request by request so that load on the machine falls on all of them alike.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings

from .exit_default import held_out
from .fixtures import addresses, median_ms, nodes
from .shipped import layout

FRACTIONS: tuple[float | None, ...] = (0.25, 0.5, 0.75, 1.0, 1.5, None)  # deadline / the full p50; None: no deadline
CALIBRATION = 30  # batch-1 full-depth requests that set the full path's p50 (and warm the nodes up)


async def run(families: list[tuple[str, Path]], requests: int) -> dict[str, Any]:
    """families: (family name, the member whose nodes and policy serve it)."""
    out: dict[str, Any] = {"requests": requests, "fractions": list(FRACTIONS), "families": {}}
    for name, member in families:
        out["families"][name] = await _family(member, requests)
    return out


async def _family(member: Path, requests: int) -> dict[str, Any]:
    inputs, labels, first = held_out(member, requests + CALIBRATION)
    warm, measured = inputs[:CALIBRATION], inputs[CALIBRATION:]
    with nodes(layout([member])) as procs:
        coord = Coordinator(CoordinatorSettings(model_dir=member, peers=addresses(procs), mdns=False))
        await coord.start()
        try:
            full_ms = await _full_p50_ms(coord, warm)
            deadlines = [None if f is None else round(full_ms * f, 2) for f in FRACTIONS]
            rows = await _interleaved(coord, measured, labels[CALIBRATION:], deadlines)
            policy, depth_rule = coord.router.adaptive.to_json(), coord.router.depth_rule.to_json()
        finally:
            await coord.stop()
    return {
        "member": f"{member.parent.name}/{member.name}",
        "test_indices": [first + CALIBRATION, first + CALIBRATION + len(measured)],
        "policy": policy,
        "depth_rule": depth_rule,
        "full_path_p50_ms": full_ms,
        "curve": [_summary(f, d, rows[d]) for f, d in zip(FRACTIONS, deadlines, strict=True)],
    }


async def _full_p50_ms(coord: Coordinator, inputs: list[torch.Tensor]) -> float:
    seconds = []
    for i, x in enumerate(inputs):
        started = time.perf_counter()
        await coord.router.classify(x, ClassifyOptions(seed=100_000 + i, exit_rule="none"))
        seconds.append(time.perf_counter() - started)
    return median_ms(seconds[len(seconds) // 3 :])  # the first ones include each new node's checked hops


async def _interleaved(
    coord: Coordinator, inputs: list[torch.Tensor], labels: list[int], deadlines: list[float | None]
) -> dict[float | None, list[dict[str, float]]]:
    rows: dict[float | None, list[dict[str, float]]] = {d: [] for d in deadlines}
    for i, (x, label) in enumerate(zip(inputs, labels, strict=True)):
        order = deadlines if i % 2 == 0 else deadlines[::-1]
        for deadline in order:
            started = time.perf_counter()
            result = await coord.router.classify(x, ClassifyOptions(seed=i, deadline_ms=deadline))
            seconds = time.perf_counter() - started
            rows[deadline].append(
                {
                    "correct": float(int(result.probs.argmax(-1)[0]) == label),
                    "blocks": float(result.path.depth),
                    "anytime": float(result.path.anytime),
                    "exited": float(result.path.exited_early),
                    "seconds": seconds,
                    "in_time": float(deadline is None or seconds * 1e3 <= deadline),
                }
            )
    return rows


def _summary(fraction: float | None, deadline_ms: float | None, rows: list[dict[str, float]]) -> dict[str, Any]:
    blocks = [int(r["blocks"]) for r in rows]
    cut = [int(r["blocks"]) for r in rows if r["anytime"]]

    def share(key: str) -> float:
        return round(statistics.fmean(r[key] for r in rows), 4)

    return {
        "fraction_of_full_p50": fraction,
        "deadline_ms": deadline_ms,
        "accuracy": share("correct"),
        "mean_blocks": round(statistics.fmean(blocks), 3),
        "fewest_blocks_cut": min(cut) if cut else None,  # never below the anytime floor
        "fewest_blocks_exited": min((int(r["blocks"]) for r in rows if r["exited"]), default=None),
        "cut_by_deadline": share("anytime"),
        "exited_early": share("exited"),
        "within_deadline": share("in_time"),
        "latency_p50_ms": median_ms([r["seconds"] for r in rows]),
        "blocks_histogram": {str(d): blocks.count(d) for d in sorted(set(blocks))},
    }
