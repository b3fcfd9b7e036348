"""Network-aware paths: pure logic, measurements in, plan out (docs/relay.md).

The expected time of a path is its nodes' compute plus its transfers. In a relay chain the transfers
are coordinator -> first node, each node -> the next, last node -> coordinator; in star every hop is a
round trip to the coordinator, so there the order does not matter and only the replica per step does.

For shuffle-robust families the order is free: a greedy nearest-neighbour tour from the coordinator
(co-located nodes are nearly free to cross, so they come out consecutive), improved by 2-opt
reversals (which removes extra crossings of a slow link), then the best replica per step for that
order by dynamic programming. Sequential families keep block order and get only the replica choice.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..membership.linkmap import COORDINATOR
from ..membership.records import NodeRecord
from .planner import Plan, Step

SAME_HOST_MS = 0.05  # an unmeasured link between two nodes of one host: a local copy
MAX_2OPT_ROUNDS = 20


class LinkCosts(Protocol):
    def transfer_ms(self, src: str, dst: str, nbytes: int) -> float | None: ...


@dataclass
class NetPlan:
    plan: Plan
    predicted_ms: float
    legs_ms: list[float]  # the transfers the prediction counts, in path order


@dataclass
class _Model:
    by_block: dict[int, list[NodeRecord]]
    costs: LinkCosts
    nbytes: int
    compute: Callable[[NodeRecord], float]
    fallback_ms: float  # an unmeasured link between hosts

    def edge(self, src: str, dst: str) -> float:
        if src == dst:
            return 0.0
        measured = self.costs.transfer_ms(src, dst, self.nbytes)
        if measured is not None:
            return measured
        if COORDINATOR not in (src, dst) and _host(src) == _host(dst):
            return SAME_HOST_MS
        return self.fallback_ms

    def relay_legs(self, seq: list[NodeRecord]) -> list[float]:
        stops = [COORDINATOR, *(r.address for r in seq), COORDINATOR]
        return [self.edge(a, b) for a, b in itertools.pairwise(stops)]

    def relay_cost(self, seq: list[NodeRecord]) -> float:
        return sum(self.relay_legs(seq)) + sum(self.compute(r) for r in seq)

    def star_cost(self, r: NodeRecord) -> float:
        return self.edge(COORDINATOR, r.address) + self.compute(r) + self.edge(r.address, COORDINATOR)


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def default_link_ms(costs_known: list[float], nbytes: int, default_mbps: float = 100.0) -> float:
    """What an unmeasured link between hosts is assumed to cost: the median measured one, else a
    `default_mbps` link."""
    return statistics.median(costs_known) if costs_known else nbytes * 8 / (default_mbps * 1e3)


def network_plan(
    by_block: dict[int, list[NodeRecord]],
    blocks: list[int],
    costs: LinkCosts,
    nbytes: int,
    compute_ms: Callable[[NodeRecord], float],
    keep_order: bool,
    relay: bool,
    fallback_ms: float,
) -> NetPlan:
    """Order `blocks` (unless keep_order) and pick each step's node to minimise the expected time."""
    model = _Model(by_block, costs, nbytes, compute_ms, fallback_ms)
    blocks = [b for b in blocks if by_block.get(b)]
    if not relay:
        chosen = [min(by_block[b], key=lambda r: (model.star_cost(r), r.address)) for b in blocks]
        legs = [leg for r in chosen for leg in (model.edge(COORDINATOR, r.address), model.edge(r.address, COORDINATOR))]
        return _result(by_block, chosen, sum(model.star_cost(r) for r in chosen), legs, compute_ms)
    order = blocks if keep_order else _two_opt(_greedy(by_block, blocks, model), model)
    chosen = _best_replicas(by_block, order, model)
    return _result(by_block, chosen, model.relay_cost(chosen), model.relay_legs(chosen), compute_ms)


def _result(
    by_block: dict[int, list[NodeRecord]],
    chosen: list[NodeRecord],
    predicted: float,
    legs: list[float],
    compute_ms: Callable[[NodeRecord], float],
) -> NetPlan:
    steps = []
    for record in chosen:
        others = [r for r in by_block[record.block] if r is not record]
        others.sort(key=lambda r: (compute_ms(r), r.address))
        steps.append(Step(block=record.block, candidates=[record, *others]))
    return NetPlan(Plan(steps=steps, unreachable=[]), predicted, legs)


def _greedy(by_block: dict[int, list[NodeRecord]], blocks: list[int], model: _Model) -> list[int]:
    """Nearest neighbour from the coordinator over (block, replica) pairs: a block order."""
    left, here, order = set(blocks), COORDINATOR, []
    while left:
        block, record = min(
            ((b, r) for b in left for r in by_block[b]),
            key=lambda br: (model.edge(here, br[1].address) + model.compute(br[1]), br[1].address),
        )
        order.append(block)
        left.discard(block)
        here = record.address
    return order


def _two_opt(order: list[int], model: _Model) -> list[int]:
    """Reverse stretches of the order while that shortens the path (with the replicas re-picked)."""
    best = list(order)
    best_cost = _order_cost(best, model)
    for _ in range(MAX_2OPT_ROUNDS):
        improved = False
        for i in range(len(best) - 1):
            for j in range(i + 1, len(best)):
                trial = best[:i] + best[i : j + 1][::-1] + best[j + 1 :]
                cost = _order_cost(trial, model)
                if cost < best_cost - 1e-9:
                    best, best_cost, improved = trial, cost, True
        if not improved:
            break
    return best


def _order_cost(order: list[int], model: _Model) -> float:
    return model.relay_cost(_best_replicas(model.by_block, order, model))


def _best_replicas(by_block: dict[int, list[NodeRecord]], order: list[int], model: _Model) -> list[NodeRecord]:
    """For a fixed block order, the replica per step minimising compute plus transfers (Viterbi)."""
    if not order:
        return []
    layer = {r.address: (model.edge(COORDINATOR, r.address) + model.compute(r), [r]) for r in by_block[order[0]]}
    for block in order[1:]:
        nxt: dict[str, tuple[float, list[NodeRecord]]] = {}
        for r in by_block[block]:
            cost, path = min(
                ((c + model.edge(p[-1].address, r.address), p) for c, p in layer.values()),
                key=lambda cp: (cp[0], cp[1][-1].address),
            )
            nxt[r.address] = (cost + model.compute(r), [*path, r])
        layer = nxt
    _, best = min(
        ((c + model.edge(p[-1].address, COORDINATOR), p) for c, p in layer.values()),
        key=lambda cp: (cp[0], cp[1][-1].address),
    )
    return best


def plan_from_registry(
    by_block: dict[int, list[NodeRecord]],
    blocks: list[int],
    costs: LinkCosts,
    nbytes: int,
    keep_order: bool,
    relay: bool,
) -> NetPlan:
    """`network_plan` with the assumptions filled in from what is known: an unmeasured node computes
    like the median measured one; an unmeasured link between hosts costs like the median measured
    coordinator link (else the median measured link between hosts, else 100 Mbit/s)."""
    records = [r for rs in by_block.values() for r in rs]
    known_compute = [r.ewma_ms for r in records if r.ewma_ms is not None]
    typical = statistics.median(known_compute) if known_compute else 1.0
    # an unmeasured link between hosts: like the measured coordinator links, else like any measured link
    coordinator_links = [costs.transfer_ms(COORDINATOR, r.address, nbytes) for r in records]
    known = [ms for ms in coordinator_links if ms is not None]
    if not known:
        pairs = [costs.transfer_ms(a.address, b.address, nbytes) for a in records for b in records if a is not b]
        known = [ms for ms in pairs if ms is not None and ms > SAME_HOST_MS]
    fallback = default_link_ms(known, nbytes)

    def compute(record: NodeRecord) -> float:
        return record.ewma_ms if record.ewma_ms is not None else typical

    return network_plan(by_block, blocks, costs, nbytes, compute, keep_order, relay, fallback)
