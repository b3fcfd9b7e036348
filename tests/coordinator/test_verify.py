"""Verification, strict admission and the evaluated policy, in process (the attack suite runs real
processes: tests/coordinator/test_attacks_rogue.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from layerswarm.coordinator import CoordinatorSettings
from layerswarm.coordinator.assembly import readiness_minimum
from layerswarm.coordinator.membership.records import FamilySpec, NodeIdentity, NodeRecord, NodeState
from layerswarm.coordinator.membership.registry import Registry
from layerswarm.coordinator.membership.tips import TIP_HOPS
from layerswarm.coordinator.verification.verifier import Lie, Verifier, VerifySettings
from layerswarm.models import policy
from layerswarm.models.checkpoint import load_block, load_model, read_manifest
from layerswarm.training.evaluation.evaluate import activation_stats, min_useful_depth
from layerswarm.wire.discovery import PROTOCOL_VERSION


def identity(model_id: str, block: int = 0, boot: str = "boot-1", family: str = "fam") -> NodeIdentity:
    return NodeIdentity(family, model_id, block, "layershuffle", "sha", boot, PROTOCOL_VERSION, 3, 5, 32, True)


def record_for(model_id: str, block: int = 0) -> NodeRecord:
    return NodeRecord(
        address="10.0.0.9:1", source="static", state=NodeState.HEALTHY, identity=identity(model_id, block)
    )


async def test_honest_reply_passes_and_a_wrong_one_is_convicted_with_evidence(family_dirs: list[Path]) -> None:
    verifier = Verifier(family_dirs, VerifySettings(rate=0.0, probation_hops=5), seed=0)
    model_id = read_manifest(family_dirs[0]).model_id
    block = load_block(family_dirs[0], 1)
    x = torch.randn(2, 5, 32)
    honest = block(x.half().float(), 2).detach()  # what a node computes from the fp16 input it receives
    record = record_for(model_id, 1)
    await verifier.check(record, x, honest.half().float(), 2, torch.float16)
    with pytest.raises(Lie) as caught:
        await verifier.check(record, x, honest * 1.05, 2, torch.float16)  # 5 % off: far past fp16 rounding
    evidence = caught.value.evidence
    assert evidence["check"] == "re-execution" and evidence["hops_before_detection"] == 2
    assert model_id in evidence["against"] and evidence["tolerance"] < 0.05


async def test_after_probation_only_a_sample_is_reexecuted(family_dirs: list[Path]) -> None:
    verifier = Verifier(family_dirs, VerifySettings(rate=0.0, probation_hops=1), seed=0)
    record = record_for(read_manifest(family_dirs[0]).model_id)
    x = torch.randn(1, 5, 32)
    await verifier.check(record, x, load_block(family_dirs[0], 0)(x.half().float(), 0).detach(), 0, torch.float16)
    await verifier.check(record, x, x * 1.01, 0, torch.float16)  # rate 0, no statistics: a lie slips through
    assert verifier.stats()["hops_reexecuted"] == 1 and verifier.stats()["hops_seen"] == 2


async def test_activation_statistics_force_reexecution_of_an_odd_reply(family_dirs: list[Path], tmp_path: Path) -> None:
    own = Path(shutil.copytree(family_dirs[0], tmp_path / "own"))
    model, _ = load_model(own)
    policy.write_entry(own, policy.ACTIVATION_STATS, activation_stats(model, torch.rand(16, 3, 16, 16)))
    verifier = Verifier([own, *family_dirs[1:]], VerifySettings(rate=0.0, probation_hops=0), seed=0)
    record = record_for(read_manifest(own).model_id)
    with pytest.raises(Lie) as caught:
        await verifier.check(record, torch.randn(1, 5, 32), torch.zeros(1, 5, 32), 0, torch.float16)
    assert "RMS" in caught.value.evidence["range_filter"]  # flagged by the filter, convicted by re-execution
    assert verifier.stats()["hops_flagged_by_range"] == 1


def test_policy_is_outside_the_model_id_and_sets_min_blocks(family_dirs: list[Path], tmp_path: Path) -> None:
    own = Path(shutil.copytree(family_dirs[2], tmp_path / "own"))
    before = read_manifest(own)
    settings = CoordinatorSettings(model_dir=own)
    assert readiness_minimum(settings, before)[0] == 1  # never evaluated
    depth = min_useful_depth(
        {"1": {"arbitrary": 0.3}, "2": {"arbitrary": 0.975}, "3": {"arbitrary": 0.98}}, "arbitrary"
    )
    assert depth["value"] == 2
    after = policy.write_entry(own, policy.MIN_BLOCKS, depth)
    assert after.model_id == before.model_id and read_manifest(own).model_id == before.model_id
    assert readiness_minimum(settings, read_manifest(own))[0] == 2
    assert readiness_minimum(CoordinatorSettings(model_dir=own, min_blocks=3), after)[0] == 3


def test_min_useful_depth_keeps_the_margin() -> None:
    curve = {"1": {"sequential": 0.5}, "2": {"sequential": 0.96}, "3": {"sequential": 0.97}, "4": {"sequential": 0.975}}
    assert min_useful_depth(curve, "sequential", margin=0.01)["value"] == 3
    assert min_useful_depth(curve, "sequential", margin=0.02)["value"] == 2


def test_strict_mode_refuses_unlisted_models_and_convictions_outlast_the_cool_down() -> None:
    now = [0.0]
    known = {("mdl-a", 0): "sha"}
    strict = Registry(
        FamilySpec("fam", 3, 5, 32, known, strict=True),
        quarantine_s=1.0,
        conviction_cooldown_s=60.0,
        clock=lambda: now[0],
    )
    assert strict.admit("n1:1", identity("mdl-forged")).state is NodeState.IGNORED
    assert strict.admit("n2:1", identity("mdl-a")).state is NodeState.HEALTHY
    lax = Registry(FamilySpec("fam", 3, 5, 32, known, strict=False))
    assert lax.admit("n1:1", identity("mdl-forged")).state is NodeState.HEALTHY
    strict.quarantine("n2:1", "lied", {"check": "re-execution"})
    now[0] = 10.0
    strict.health_ok("n2:1")
    assert strict.nodes["n2:1"].state is NodeState.QUARANTINED  # evidence: no release after the cool-down
    assert strict.nodes["n2:1"].to_json()["evidence"] == [{"check": "re-execution"}]
    # A new boot id is the node's own claim: it stays out for the conviction's cool-down too (test_convictions.py).
    assert strict.admit("n2:1", identity("mdl-a", boot="boot-2")).state is NodeState.QUARANTINED
    now[0] = 60.0
    strict.health_ok("n2:1")
    assert strict.nodes["n2:1"].state is NodeState.HEALTHY  # restarted, after the cool-down: on probation


async def test_verification_state_of_nodes_that_left_is_dropped(family_dirs: list[Path]) -> None:
    """Nodes that come and go on new addresses (a restart on a fresh port) must not each leave their
    verification state behind for the life of the coordinator: it is dropped when the registry
    forgets the node, so it stays bounded by the nodes known now."""
    from layerswarm.coordinator import Coordinator

    manifest = read_manifest(family_dirs[0])
    coordinator = Coordinator(CoordinatorSettings(model_dir=family_dirs[0], mdns=False, verify_rate=0.05))
    verifier, registry = coordinator.verifier, coordinator.registry
    assert verifier is not None
    overflow = torch.full((1, 5, 32), 60000.0)  # convicted by the hard range check: no re-execution needed
    try:
        for port in range(20000, 20200):
            address = f"127.0.0.1:{port}"
            registry.add_candidate(address, "dns", hint="dns:nodes.local")
            record = registry.admit(address, identity(manifest.model_id, family=manifest.family_id, boot=str(port)))
            with pytest.raises(Lie):
                await verifier.check(record, torch.zeros(1, 5, 32), overflow, 0, torch.float16)
            assert registry.drop_hint(address, "dns:nodes.local")
            registry.forget(address, "no longer listed, and not answering")
        assert not registry.nodes
        assert verifier.tracked == 0, f"{verifier.tracked} addresses still tracked after every node left"
    finally:
        verifier.close()


@pytest.mark.parametrize("asks_first", [False, True])
def test_a_tip_buys_exactly_the_next_tip_hops_reexecutions(family_dirs: list[Path], asks_first: bool) -> None:
    """A tip re-executes the node's next TIP_HOPS hops, however its hops are screened: star screens
    them directly, relay chains and the like ask `wants` first. When both spent it, a tip bought half."""
    verifier = Verifier(family_dirs, VerifySettings(rate=0.0, probation_hops=0), seed=0)  # nothing sampled
    record = record_for(read_manifest(family_dirs[0]).model_id)
    x = torch.randn(1, 5, 32)
    out = load_block(family_dirs[0], 0)(x.half().float(), 0).detach()
    verifier.screen(record, x, out, 0, torch.float16)  # seen once, unchecked: no tip yet
    verifier.tip(record.address, TIP_HOPS)
    chosen, wanted = [], []
    for _ in range(TIP_HOPS + 3):
        if asks_first:
            wanted.append(verifier.wants(record))
        chosen.append(verifier.screen(record, x, out, 0, torch.float16) is not None)
    assert chosen == [True] * TIP_HOPS + [False] * 3
    assert wanted == ([True] * TIP_HOPS + [False] * 3 if asks_first else [])
