"""Spot re-execution on replicas with the same weights hash (coordinator/peer_check.py): the majority
logic in process, then a rogue among real replica processes caught without the coordinator computing."""

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


async def test_a_node_agreeing_with_its_first_referee_passes() -> None:
    node, a, b = replica(1), replica(2), replica(3)
    verdict = await judge(node, [a, b], answers({a.address: TRUTH, b.address: LIE}), against(TRUTH), 1e-3)
    assert verdict is not None and verdict.passed and verdict.liar is None and verdict.asked == 1


async def test_two_referees_that_agree_against_the_node_convict_it() -> None:
    node, a, b = replica(1), replica(2), replica(3)
    verdict = await judge(node, [a, b], answers({a.address: TRUTH, b.address: TRUTH}), against(LIE), 1e-3)
    assert verdict is not None and not verdict.passed and verdict.liar == node.address
    assert verdict.evidence is not None and "same weights" in verdict.evidence["against"]


async def test_a_lying_referee_is_outvoted_and_convicted_not_the_node() -> None:
    node, liar, b = replica(1), replica(2), replica(3)
    verdict = await judge(node, [liar, b], answers({liar.address: LIE, b.address: TRUTH}), against(TRUTH), 1e-3)
    assert verdict is not None and verdict.passed and verdict.liar == liar.address


async def test_one_word_against_another_convicts_nobody_unless_the_coordinator_breaks_the_tie() -> None:
    node, a = replica(1), replica(2)
    verdict = await judge(node, [a], answers({a.address: LIE}), against(TRUTH), 1e-3)
    assert verdict is not None and not verdict.passed and verdict.liar is None  # unresolved

    async def coordinator_copy() -> torch.Tensor:
        return TRUTH

    verdict = await judge(node, [a], answers({a.address: LIE}), against(TRUTH), 1e-3, coordinator_copy)
    assert verdict is not None and verdict.passed and verdict.liar == a.address


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
        if where == "peers":
            assert record.evidence[0]["check"] == "re-execution on peers"
            assert stats["hops_reexecuted_on_peers"] > 0 and stats["peer_calls"] > 0
        else:
            assert record.evidence[0]["check"] == "re-execution" and stats["peer_calls"] == 0
        honest_block0 = [coord.registry.nodes[address(p)] for p in honest[:2]]
        assert not any(r.convicted for r in honest_block0)  # the liar's word convicted no honest replica
    finally:
        await coord.stop()


async def test_a_referee_caught_lying_is_quarantined_through_the_coordinator(family_dirs: list[Path]) -> None:
    from layerswarm.coordinator.verification.verifier import Verifier, VerifySettings

    verifier = Verifier(family_dirs[1:], VerifySettings(rate=1.0, probation_hops=0, reexecute_on="peers"), seed=0)
    quarantined: list[tuple[str, dict[str, object]]] = []
    verifier.quarantine_referee = lambda address, reason, evidence: quarantined.append((address, evidence))
    node, liar, honest = replica(1), replica(2), replica(3)
    x = torch.randn(1, 5, 32)
    replies = {liar.address: torch.zeros_like(x), honest.address: x}
    for _ in range(8):  # referees are asked in random order: sooner or later the liar is asked first
        await verifier.check(node, x, x, 0, torch.float16, replicas=lambda: [liar, honest], ask=answers(replies))
        if quarantined:
            break
    assert [a for a, _ in quarantined] == [liar.address]
    evidence = quarantined[0][1]
    assert evidence["check"] == "re-execution on peers" and "hops_before_detection" in evidence
    assert verifier.stats()["hops_reexecuted"] == 0  # all judged by replicas, none by the coordinator
