"""The network-aware planner (pure): co-located nodes run consecutively, a slow link is crossed once,
sequential families keep their order and get the best replica, star picks replicas only."""

from __future__ import annotations

import itertools

from layerswarm.coordinator.membership.linkmap import COORDINATOR, LinkMap
from layerswarm.coordinator.membership.records import NodeIdentity, NodeRecord, NodeState
from layerswarm.coordinator.routing.netorder import network_plan, plan_from_registry
from layerswarm.wire.discovery import PROTOCOL_VERSION

NBYTES = 1_000_000  # one 1 MB activation: the link costs below are in ms per MB


def node(address: str, block: int, ewma_ms: float = 5.0) -> NodeRecord:
    ident = NodeIdentity("fam", "m", block, "layershuffle", "sha", "boot", PROTOCOL_VERSION, 8, 5, 32, True)
    return NodeRecord(address, "static", state=NodeState.HEALTHY, identity=ident, ewma_ms=ewma_ms)


def hosts(*layout: str) -> dict[int, list[NodeRecord]]:
    """Block i on host layout[i] (port 9000 + i)."""
    return {i: [node(f"{h}:{9000 + i}", i)] for i, h in enumerate(layout)}


def two_site_links(by_block: dict[int, list[NodeRecord]], slow: float = 80.0, fast: float = 8.0) -> LinkMap:
    """Nodes on hosts 10.0.0.* and 10.0.1.* are two sites; between sites links are 10x slower."""
    links = LinkMap()
    records = [r for rs in by_block.values() for r in rs]
    for a, b in itertools.permutations(records, 2):
        same_site = a.host.rsplit(".", 1)[0] == b.host.rsplit(".", 1)[0]
        links.observe(a.address, b.address, NBYTES, fast if same_site else slow)
    for r in records:
        links.observe(COORDINATOR, r.address, NBYTES, fast)
        links.observe(r.address, COORDINATOR, NBYTES, fast)
    return links


def crossings(order: list[NodeRecord]) -> int:
    sites = [r.host.rsplit(".", 1)[0] for r in order]
    return sum(a != b for a, b in itertools.pairwise(sites))


def test_co_located_nodes_run_consecutively() -> None:
    by_block = hosts("10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.2")
    plan = plan_from_registry(by_block, list(by_block), LinkMap(), NBYTES, keep_order=False, relay=True)
    order = [s.candidates[0].host for s in plan.plan.steps]
    assert sorted(order) == sorted(r.host for rs in by_block.values() for r in rs)
    assert sum(a != b for a, b in itertools.pairwise(order)) == 1  # host A's three, then host B's three


def test_a_slow_link_is_crossed_once() -> None:
    by_block = hosts("10.0.0.1", "10.0.1.1", "10.0.0.2", "10.0.1.2", "10.0.0.3", "10.0.1.3")
    links = two_site_links(by_block)
    blocks = list(by_block)
    plan = network_plan(by_block, blocks, links, NBYTES, lambda r: 5.0, keep_order=False, relay=True, fallback_ms=8)
    chosen = [s.candidates[0] for s in plan.plan.steps]
    assert crossings(chosen) == 1
    # the block order as given crosses five times: the prediction says how much that costs
    given = network_plan(by_block, blocks, links, NBYTES, lambda r: 5.0, keep_order=True, relay=True, fallback_ms=8)
    assert crossings([s.candidates[0] for s in given.plan.steps]) == 5
    assert plan.predicted_ms == 6 * 5.0 + 8 * 6 + 80  # compute, 6 fast legs, one slow one
    assert given.predicted_ms > plan.predicted_ms


def test_sequential_keeps_order_and_picks_the_replica_on_the_fast_side() -> None:
    by_block = {
        0: [node("10.0.0.1:1", 0)],
        1: [node("10.0.1.1:2", 1), node("10.0.0.2:2", 1)],  # one replica across the slow link, one near
        2: [node("10.0.0.3:3", 2)],
    }
    links = two_site_links(by_block)
    plan = network_plan(by_block, [0, 1, 2], links, NBYTES, lambda r: 5.0, keep_order=True, relay=True, fallback_ms=8)
    assert [s.block for s in plan.plan.steps] == [0, 1, 2]
    assert plan.plan.steps[1].candidates[0].address == "10.0.0.2:2"
    assert [r.address for r in plan.plan.steps[1].candidates] == ["10.0.0.2:2", "10.0.1.1:2"]  # fallback kept


def test_star_picks_the_replica_with_the_cheapest_round_trip() -> None:
    by_block = {0: [node("10.0.0.1:1", 0, ewma_ms=5.0), node("10.0.0.2:1", 0, ewma_ms=1.0)]}
    links = LinkMap()
    for address, ms in (("10.0.0.1:1", 1.0), ("10.0.0.2:1", 50.0)):
        links.observe(COORDINATOR, address, NBYTES, ms)
        links.observe(address, COORDINATOR, NBYTES, ms)
    plan = plan_from_registry(by_block, [0], links, NBYTES, keep_order=True, relay=False)
    assert plan.plan.steps[0].candidates[0].address == "10.0.0.1:1"  # 5 + 2 ms beats 1 + 100 ms
    assert plan.predicted_ms == 7.0


def test_auto_topology_tries_both_then_keeps_to_the_faster_per_hop() -> None:
    import random

    from layerswarm.coordinator.routing.topology import MIN_SAMPLES, TopologyChooser

    chooser = TopologyChooser(random.Random(0))
    tried = []
    for _ in range(2 * MIN_SAMPLES):
        topology = chooser.choose()
        tried.append(topology)
        chooser.observe(topology, 100.0 if topology == "relay" else 300.0, hops=10)  # relay 10 ms/hop, star 30
    assert sorted(tried) == ["relay"] * MIN_SAMPLES + ["star"] * MIN_SAMPLES
    picks = [chooser.choose() for _ in range(400)]
    assert 0.85 < picks.count("relay") / len(picks) < 1.0  # mostly relay, star still explored now and then


def test_times_that_are_not_finite_never_reach_a_link_estimate() -> None:
    """Link times come partly from nodes' own reports: one NaN or inf must not poison an average."""
    links = LinkMap()
    links.observe("a", "b", 1_000_000, 10.0)
    links.observe_rtt("a", "b", 2.0)
    for bad in (float("nan"), float("inf"), -float("inf")):
        links.observe("a", "b", 1_000_000, bad)
        links.observe_rtt("a", "b", bad)
    assert links.per_mb("a", "b") == 10.0
    assert links.transfer_ms("a", "b", 1_000_000) == 11.0  # half the 2 ms RTT + 10 ms per MB
    links.observe("c", "d", 1_000_000, float("nan"))
    assert links.per_mb("c", "d") is None  # no finite sample: not measured at all
