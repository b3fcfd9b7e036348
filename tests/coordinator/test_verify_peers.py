"""Spot re-execution on replicas with the same weights hash (coordinator/peer_check.py): the judgement
in process (the coordinator's copy decides a disagreement, or it is contested), then a rogue among
real replica processes caught."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, Policy
from layerswarm.coordinator.membership.records import NodeIdentity, NodeRecord, NodeState
from layerswarm.coordinator.verification.peer_check import judge, same_weights
from layerswarm.harness.procs import Proc, spawn, stop_all
from layerswarm.wire.discovery import PROTOCOL_VERSION

from ..swarm import address, coordinator, node_cmd, start_nodes, wait_until

TRUTH = torch.ones(1, 5, 32)
LIE = torch.zeros(1, 5, 32)


def replica(n: int, sha: str = "sha-a", model: str = "m") -> NodeRecord:
    ident = NodeIdentity("fam", model, 0, "layershuffle", sha, f"boot-{n}", PROTOCOL_VERSION, 3, 5, 32, True)
    return NodeRecord(address=f"10.0.0.{n}:1", source="static", state=NodeState.HEALTHY, identity=ident)


def answers(replies: dict[str, torch.Tensor | None]):  # type: ignore[no-untyped-def]
    async def ask(peer: NodeRecord) -> torch.Tensor | None:
        return replies[peer.address]

    return ask


def against(out: torch.Tensor):  # type: ignore[no-untyped-def]
    return lambda ref: float((out - ref).abs().max())


def copy_says(out: torch.Tensor):  # type: ignore[no-untyped-def]
    async def own_copy() -> torch.Tensor:
        return out

    return own_copy


async def test_a_node_agreeing_with_its_referee_passes() -> None:
    node, a, b = replica(1), replica(2), replica(3)
    verdict = await judge(node, [a, b], answers({a.address: TRUTH, b.address: LIE}), against(TRUTH), 1e-3)
    assert verdict is not None and verdict.passed and verdict.convicted == () and verdict.asked == 1


async def test_a_disagreement_is_decided_by_the_coordinators_copy_alone() -> None:
    node, a = replica(1), replica(2)
    lied_to = await judge(node, [a], answers({a.address: LIE}), against(TRUTH), 1e-3, copy_says(TRUTH))
    assert lied_to is not None and lied_to.passed and lied_to.convicted == (a.address,)
    caught = await judge(node, [a], answers({a.address: TRUTH}), against(LIE), 1e-3, copy_says(TRUTH))
    assert caught is not None and not caught.passed and caught.convicted == (node.address,)


async def test_without_a_copy_a_disagreement_is_contested_and_convicts_nobody() -> None:
    node, a = replica(1), replica(2)
    verdict = await judge(node, [a], answers({a.address: LIE}), against(TRUTH), 1e-3)
    assert verdict is not None and not verdict.passed and verdict.contested and verdict.convicted == ()


async def test_three_colluding_referees_never_convict_the_honest_node() -> None:
    """Before: two referees agreeing against a node convicted it, so colluders convicted the honest."""
    honest, colluders = replica(1), [replica(n) for n in (2, 3, 4)]
    lies = answers({c.address: LIE for c in colluders})
    for copy in (copy_says(TRUTH), None):
        verdict = await judge(honest, colluders, lies, against(TRUTH), 1e-3, copy)
        assert verdict is not None and honest.address not in verdict.convicted
        if copy is None:
            assert verdict.contested
        else:
            assert verdict.passed and set(verdict.convicted) <= {c.address for c in colluders}


async def test_silent_referees_leave_the_judgement_to_the_caller() -> None:
    node, a = replica(1), replica(2)
    assert await judge(node, [a], answers({a.address: None}), against(TRUTH), 1e-3) is None


def test_only_routable_nodes_with_the_very_same_weights_are_replicas() -> None:
    node, twin, other_hash, other_model, down = (
        replica(1),
        replica(2),
        replica(3, "sha-b"),
        replica(4, model="n"),
        replica(5),
    )
    down.state = NodeState.EJECTED
    assert same_weights(node, [node, twin, other_hash, other_model, down]) == [twin]


# --- real processes ------------------------------------------------------------------------------------


@pytest.fixture
def swarm(family_dirs: list[Path]) -> Iterator[tuple[list[Proc], Proc]]:
    """Three replicas of block 0 of the coordinator's own model (one of them lies: noise), and a
    sibling member's blocks 1 and 2."""
    args = node_cmd(family_dirs[0], 0, "--no-advertise")[4:]
    rogue = spawn("rogue-noise", [sys.executable, "-m", "layerswarm.harness.faults", *args, "--fault-mode", "noise"])
    honest = start_nodes([(family_dirs[0], 0), (family_dirs[0], 0), (family_dirs[1], 1), (family_dirs[1], 2)])
    yield honest, rogue
    stop_all([*honest, rogue])


@pytest.mark.parametrize("where", ["peers", "coordinator"])
async def test_a_rogue_replica_is_caught_by_its_peers_without_coordinator_compute(
    family_dirs: list[Path], swarm: tuple[list[Proc], Proc], where: str
) -> None:
    honest, rogue = swarm
    coord = coordinator(family_dirs[0], [*honest, rogue], family_dirs=(family_dirs[1],), verify_on=where)
    await coord.start()
    try:
        await wait_until(lambda: sum(r.routable for r in coord.registry.nodes.values()) == 5, what="all admitted")
        for seed in range(12):
            await coord.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL, seed=seed))
            if coord.registry.nodes[address(rogue)].convicted:
                break
        record = coord.registry.nodes[address(rogue)]
        assert record.state.value == "quarantined" and record.convicted
        assert coord.verifier is not None
        stats = coord.verifier.stats()
        if where == "peers":  # a decisive hop goes to the coordinator's own copy even here
            assert record.evidence[0]["check"] in ("re-execution on peers", "re-execution")
            assert stats["hops_reexecuted_on_peers"] > 0 and stats["peer_calls"] > 0
        else:
            assert record.evidence[0]["check"] == "re-execution" and stats["peer_calls"] == 0
        honest_block0 = [coord.registry.nodes[address(p)] for p in honest[:2]]
        assert not any(r.convicted for r in honest_block0)  # the liar's word convicted no honest replica
    finally:
        await coord.stop()
