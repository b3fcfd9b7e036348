"""A stream's route and who may stand in for a hop: pure logic over the registry's records.

block_order   sequential (the model's own order), or a seeded shuffle for shuffle-robust families
choose        the node for one position: the coordinator's own model first (its stem and head were
              trained with those blocks), a sibling model's block of the same index only where the
              family is shuffle-robust; then the least loaded by this coordinator's open streams
              against the node's stated limit, then the lowest latency
may_skip      a block may leave the route for the rest of a stream only while the route keeps the
              family's evaluated minimum depth (models/policy.py); a family never evaluated never skips
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from ..membership.records import NodeRecord


def block_order(depth: int, order: str, rng: random.Random) -> list[int]:
    blocks = list(range(depth))
    if order == "shuffle":
        rng.shuffle(blocks)
    return blocks


def eligible(record: NodeRecord, own_model: str, robust: bool) -> bool:
    """A node that may serve a position of one of our streams: routable, and our own model's block or
    (shuffle-robust families) a sibling's of the same index."""
    ident = record.identity
    return record.routable and ident is not None and (ident.model_id == own_model or robust)


def _load(record: NodeRecord, own_model: str, open_streams: Mapping[str, int]) -> tuple[int, float, float, str]:
    ident = record.identity
    limits = ident.stream_limits if ident is not None else None
    held = open_streams.get(record.address, 0)
    share = held / limits.max_streams if limits is not None and limits.max_streams > 0 else float(held)
    sibling = int(ident is None or ident.model_id != own_model)
    return sibling, share, record.ewma_ms if record.ewma_ms is not None else 0.0, record.address


def choose(
    candidates: Iterable[NodeRecord],
    own_model: str,
    robust: bool,
    open_streams: Mapping[str, int],
    exclude: frozenset[str] | set[str] = frozenset(),
) -> NodeRecord | None:
    """The node for one position, or None when no eligible node is left."""
    ok = [r for r in candidates if r.address not in exclude and eligible(r, own_model, robust)]
    return min(ok, key=lambda r: _load(r, own_model, open_streams)) if ok else None


def plan_route(
    by_block: Mapping[int, list[NodeRecord]],
    blocks: list[int],
    own_model: str,
    robust: bool,
    open_streams: Mapping[str, int],
) -> list[NodeRecord | None]:
    """A node per position of `blocks` (None: no eligible node serves that block now)."""
    return [choose(by_block.get(block, ()), own_model, robust, open_streams) for block in blocks]


def may_skip(active_positions: int, min_depth: int) -> bool:
    """Whether one more block may leave a route that runs `active_positions` blocks now."""
    return active_positions - 1 >= min_depth
