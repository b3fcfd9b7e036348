"""A colluding majority against one honest node, in every --verify-on mode (verification/peer_check.py):
three replicas that return the same wrong output for a block never get the honest replica convicted.
Where the coordinator holds the model its copy decides, so the colluders are the ones caught; where it
holds none, the weights are contested (nobody convicted, no replica routed to) rather than the
majority trusted. In process with the real block and verifier; test_attacks_rogue.py runs it on
real node processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerswarm.coordinator.membership.records import NodeIdentity, NodeRecord, NodeState
from layerswarm.coordinator.membership.registry import WeightsKey
from layerswarm.coordinator.verification.verifier import Contested, Lie, Verifier, VerifySettings
from layerswarm.models.checkpoint import load_block, read_manifest
from layerswarm.wire.discovery import PROTOCOL_VERSION

BLOCK = 1


def replica(model_dir: Path, n: int) -> NodeRecord:
    m = read_manifest(model_dir)
    ident = NodeIdentity(
        m.family_id, m.model_id, BLOCK, "layershuffle", m.block_sha256(BLOCK), f"boot-{n}", PROTOCOL_VERSION,
        m.config.depth, 5, m.config.dim, True,
    )  # fmt: skip
    return NodeRecord(address=f"10.0.0.{n}:1", source="static", state=NodeState.HEALTHY, identity=ident)


def honest_and_lie(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        truth = load_block(model_dir, BLOCK, read_manifest(model_dir))(x, 0)
    return x, truth, truth + 0.5 * truth.std() * torch.randn_like(truth)  # one shared lie


@pytest.mark.parametrize("mode", ["coordinator", "peers", "auto"])
@pytest.mark.parametrize("holds_copy", [True, False])
async def test_a_colluding_majority_never_convicts_the_honest_node(
    family_dirs: list[Path], mode: str, holds_copy: bool
) -> None:
    held = family_dirs if holds_copy else family_dirs[1:]
    verifier = Verifier(held, VerifySettings(rate=1.0, probation_hops=0, reexecute_on=mode), seed=0)
    caught: list[str] = []
    contested: list[WeightsKey] = []
    verifier.quarantine_referee = lambda address, reason, evidence: caught.append(address)
    verifier.contest = lambda key, reason, seconds: contested.append(key)
    honest, colluders = replica(family_dirs[0], 1), [replica(family_dirs[0], n) for n in (2, 3, 4)]
    x, truth, lie = honest_and_lie(family_dirs[0])

    async def ask(peer: NodeRecord) -> torch.Tensor:
        return truth if peer is honest else lie

    outcomes = []
    for _ in range(12):  # the honest node's every hop checked (rate 1), referees in random order
        try:
            await verifier.check(honest, x, truth, 0, torch.float32, replicas=lambda: colluders, ask=ask)
            outcomes.append("passed")
        except Contested:
            outcomes.append("contested")
        except Lie as lie_found:  # a conviction of the honest node: what the colluders are after
            pytest.fail(f"honest node convicted in mode {mode}: {lie_found.evidence}")
    for colluder in colluders:  # and each colluder's own hops, with the honest node among its referees
        try:
            await verifier.check(colluder, x, lie, 0, torch.float32, replicas=lambda: [honest], ask=ask)
            outcomes.append("colluder passed")
        except Contested:
            outcomes.append("contested")
        except Lie:
            caught.append(colluder.address)
    assert honest.address not in caught
    if holds_copy or mode == "coordinator":  # the copy (or, without one, the family envelope) decides
        assert set(caught) == {c.address for c in colluders} and "colluder passed" not in outcomes
    else:  # no copy: the disagreement is reported, not decided by the majority
        assert contested and "contested" in outcomes and "colluder passed" not in outcomes
