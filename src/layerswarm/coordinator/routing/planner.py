"""Plans a path through the swarm for one request: pure logic over the registry's live node records
(read, never changed, here: the executor then calls the chosen records and the registry updates them).

A path is an ordered list of steps; each step names one block index (used at most once per path) and
the nodes that can serve it, best first. Nodes of any model of the family serve a block index, so a
missing node is substituted by the same block of a sibling model before anything is skipped.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum

from layerswarm.models.paths import spread_evenly

from ..membership.records import NodeRecord


class Policy(str, Enum):
    SEQUENTIAL = "sequential"  # block index order: the only order a baseline-trained family survives
    SHUFFLE = "shuffle"  # a fresh random order per request, as LayerShuffle trained for
    FASTEST = "fastest"  # least loaded / lowest latency node per block
    NETWORK = "network"  # least expected time from measured compute and link costs (netorder.py)


@dataclass
class Step:
    block: int
    candidates: list[NodeRecord]
    repeat: bool = False  # this block index already ran earlier in the path: run it again on purpose


@dataclass
class Plan:
    steps: list[Step]
    unreachable: list[int]  # block indices with no routable node (skipped before the request starts)


def plan_path(
    policy: Policy,
    by_block: dict[int, list[NodeRecord]],
    depth: int,
    rng: random.Random,
    max_blocks: int | None = None,
    preferred_model: str | None = None,
    keep_to_model: bool = False,
) -> Plan:
    """Choose the blocks, their order, and each step's candidate nodes (best first). `keep_to_model`:
    the preferred model's nodes first whatever the policy (a route of an ensemble over members)."""
    present = [b for b in range(depth) if by_block.get(b)]
    unreachable = [b for b in range(depth) if not by_block.get(b)]
    limit = len(present) if max_blocks is None else min(max_blocks, len(present))
    if policy is Policy.SHUFFLE:
        blocks = rng.sample(present, limit)
    else:
        # Pruned sequential paths keep blocks spread over the depth, in order (as in the paper).
        blocks = spread_evenly(present, limit)
    steps = [
        Step(block=b, candidates=rank_candidates(policy, by_block[b], rng, preferred_model, keep_to_model))
        for b in blocks
    ]
    return Plan(steps=steps, unreachable=unreachable)


def rank_candidates(
    policy: Policy,
    nodes: list[NodeRecord],
    rng: random.Random,
    preferred_model: str | None,
    keep_to_model: bool = False,
) -> list[NodeRecord]:
    if policy is Policy.FASTEST and not keep_to_model:
        return sorted(nodes, key=lambda r: (r.score(), r.address))
    shuffled = list(nodes)
    rng.shuffle(shuffled)  # spread load over the family's models
    if (policy is Policy.SEQUENTIAL or keep_to_model) and preferred_model is not None:
        # Sequential order is what a non-robust model was trained for, and a member's route in an
        # ensemble should be that member (diversity): its own blocks first.
        shuffled.sort(key=lambda r: r.identity is None or r.identity.model_id != preferred_model)
    return shuffled


def substitutes(
    by_block: dict[int, list[NodeRecord]], used: set[int], planned: set[int], rng: random.Random, exclude: set[str]
) -> list[tuple[int, NodeRecord]]:
    """For shuffle-robust families: nodes of block indices neither used nor planned, in random order."""
    spare = [
        (b, r)
        for b, nodes in by_block.items()
        if b not in used and b not in planned
        for r in nodes
        if r.address not in exclude
    ]
    rng.shuffle(spare)
    return spare


def with_repeats(plan: Plan, min_blocks: int, rng: random.Random, shuffle: bool) -> Plan:
    """Fewer distinct block indices reachable than the minimum depth: run present ones again (any
    order, any number of times) until the path is `min_blocks` long, instead of failing."""
    if not plan.steps or len(plan.steps) >= min_blocks:
        return plan
    steps = list(plan.steps)
    while len(steps) < min_blocks:
        steps.append(rng.choice(plan.steps))
    if shuffle:
        rng.shuffle(steps)
    else:
        steps.sort(key=lambda s: s.block)  # a sequential path runs a repeated block twice in a row
    seen: set[int] = set()
    out = []
    for step in steps:
        out.append(Step(step.block, step.candidates, repeat=step.block in seen))
        seen.add(step.block)
    return Plan(steps=out, unreachable=plan.unreachable)
