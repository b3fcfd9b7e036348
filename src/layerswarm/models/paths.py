"""Which blocks a pruned sequential path keeps: one rule for the swarm's planner and the evaluation
(the accuracy the evaluation reports for k blocks is the accuracy the swarm delivers with k blocks)."""

from __future__ import annotations

from collections.abc import Sequence


def spread_evenly(blocks: Sequence[int], k: int) -> list[int]:
    """k of `blocks`, in their order, spread evenly from the first to the last (as in the paper's pruning)."""
    if k >= len(blocks):
        return list(blocks)
    if k <= 0:
        return []
    if k == 1:
        return [blocks[0]]
    return [blocks[round(i * (len(blocks) - 1) / (k - 1))] for i in range(k)]
