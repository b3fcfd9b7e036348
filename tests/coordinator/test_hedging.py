"""Hedged requests: a hop slower than its node's usual latency is also sent to another node; the first
answer wins; the slow call is left to finish (cancelling a grpc.aio call mid-read leaks native memory)
and its real latency is recorded, without counting as a failure."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, Policy
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.models.checkpoint import read_manifest
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings

from ..swarm import wait_until

SEQ = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0)


@pytest.fixture
async def slow_and_fast(family_dirs: list[Path]) -> AsyncIterator[tuple[Node, Node]]:
    slow = FaultyNode(
        NodeSettings(model_dir=family_dirs[0], block=0, advertise=False, grace_s=0.1), FaultSpec(delay_ms=800)
    )
    fast = Node(NodeSettings(model_dir=family_dirs[1], block=0, advertise=False, grace_s=0.1))
    for n in (slow, fast):
        await n.start()
    yield slow, fast
    for n in (slow, fast):
        await n.stop()


async def coordinator_for(family_dirs: list[Path], nodes: tuple[Node, Node], hedge: float | None) -> Coordinator:
    peers = tuple(f"127.0.0.1:{n.port}" for n in nodes)
    coord = Coordinator(
        CoordinatorSettings(
            model_dir=family_dirs[0],
            peers=peers,
            mdns=False,
            hedge_quantile=hedge,
            hedge_min_ms=5.0,
            health_interval_s=0.2,
        )
    )
    await coord.start()
    await wait_until(lambda: coord.registry.reachable_depth() == 1)
    # The slow node's history says it is usually fast (as a node that just froze up would look).
    coord.registry.nodes[peers[0]].recent_ms.extend([2.0] * 10)
    return coord


async def test_slow_hop_is_hedged_and_the_fast_answer_wins(
    family_dirs: list[Path], slow_and_fast: tuple[Node, Node]
) -> None:
    slow, fast = slow_and_fast
    coord = await coordinator_for(family_dirs, slow_and_fast, hedge=0.95)
    try:
        result = await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)
        hop = result.path.hops[0]
        assert hop.hedged_to == f"127.0.0.1:{fast.port}" and hop.node == hop.hedged_to
        assert hop.outcome == "hedged" and hop.model_id == read_manifest(family_dirs[1]).model_id
        slow_record = coord.registry.nodes[f"127.0.0.1:{slow.port}"]
        assert slow_record.in_flight == 1  # the loser is still running: not cancelled
        # its real latency (800 ms fault) is recorded once its late reply is verified, and informs its hedge delay
        await wait_until(lambda: max(slow_record.recent_ms) >= 700, what="the loser's latency recorded")
        assert slow_record.in_flight == 0
        assert slow_record.failed == 0 and slow_record.state.value == "healthy"  # it answered late, not failed
    finally:
        await coord.stop()


async def test_without_hedging_the_slow_node_answers(family_dirs: list[Path], slow_and_fast: tuple[Node, Node]) -> None:
    slow, _ = slow_and_fast
    coord = await coordinator_for(family_dirs, slow_and_fast, hedge=None)
    try:
        hop = (await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)).path.hops[0]
        assert hop.hedged_to is None and hop.outcome == "ok" and hop.node == f"127.0.0.1:{slow.port}"
    finally:
        await coord.stop()


@pytest.mark.parametrize("mode", ["nan", "shape", "dtype"])
async def test_malformed_replies_quarantine_the_node_and_the_hop_is_substituted(
    family_dirs: list[Path], mode: str
) -> None:
    liar = FaultyNode(NodeSettings(model_dir=family_dirs[0], block=0, advertise=False, grace_s=0.1), FaultSpec(mode))
    honest = Node(NodeSettings(model_dir=family_dirs[1], block=0, advertise=False, grace_s=0.1))
    for n in (liar, honest):
        await n.start()
    peers = (f"127.0.0.1:{liar.port}", f"127.0.0.1:{honest.port}")
    coord = Coordinator(CoordinatorSettings(model_dir=family_dirs[0], peers=peers, mdns=False, hedge_quantile=None))
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == 1)
        hop = (await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)).path.hops[0]  # own model (the liar) first
        assert hop.outcome == "substituted" and hop.node == peers[1]
        assert "malformed activations" in hop.attempts[0].error
        assert coord.registry.nodes[peers[0]].state.value == "quarantined"
        hop = (await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)).path.hops[0]
        assert hop.outcome == "ok" and hop.node == peers[1]  # quarantined nodes are not asked again
    finally:
        await coord.stop()
        for n in (liar, honest):
            await n.stop()
