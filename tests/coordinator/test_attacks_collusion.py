"""Colluders and targeted liars as real node processes on loopback (issue 45), each against the defence
that stops it, so each test fails without it:

- a colluding majority: three replicas of block 1 that return the same wrong output (the output of
  block 2, harness/faults.py other-block) against one honest replica. In every --verify-on mode the
  honest node is never convicted: the coordinator's copy decides (peer_check.py), and where the
  coordinator holds no copy the weights are reported contested instead of the majority believed.
- a subtle targeted liar (faults.py push): with sampling off, only the answer's decisive-hop check
  (verification/decisive.py, executor.py) catches it; with that check off it is never caught.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, Policy
from layerswarm.harness.procs import Proc, spawn_many, stop_all

from ..swarm import address, coordinator, node_cmd, start_nodes, wait_until

COLLUDED = 1


def faulty(model_dir: Path, block: int, mode: str) -> tuple[str, list[str]]:
    args = node_cmd(model_dir, block, "--no-advertise", "--grace", "0.5")[4:]
    return f"{mode}-{block}", [sys.executable, "-m", "layerswarm.harness.faults", *args, "--fault-mode", mode]


@pytest.fixture(scope="module")
def colluding_swarm(family_dirs: list[Path]) -> Iterator[tuple[list[Proc], Proc, list[Proc]]]:
    """Member 0: blocks 0 and 2 honest, block 1 one honest replica and three colluders."""
    others = start_nodes([(family_dirs[0], 0), (family_dirs[0], 2)])
    honest = start_nodes([(family_dirs[0], COLLUDED)])[0]
    colluders = spawn_many([faulty(family_dirs[0], COLLUDED, "other-block") for _ in range(3)])
    yield others, honest, colluders
    stop_all([*others, honest, *colluders])


async def drive(coord: Coordinator, requests: int) -> int:
    """Sequential requests (every one through block 1); how many failed (503: no usable path)."""
    failed = 0
    for seed in range(requests):
        try:
            await coord.router.classify(torch.rand(2, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL, seed=seed))
        except Exception:  # noqa: BLE001 - a contested block can leave no path: counted, not a test error
            failed += 1
    return failed


@pytest.mark.parametrize("mode", ["coordinator", "peers", "auto"])
async def test_a_colluding_majority_never_convicts_the_honest_replica(
    family_dirs: list[Path], colluding_swarm: tuple[list[Proc], Proc, list[Proc]], mode: str
) -> None:
    others, honest, colluders = colluding_swarm
    nodes = [*others, honest, *colluders]
    coord = coordinator(family_dirs[0], nodes, verify_on=mode, verify_rate=1.0)
    await coord.start()
    try:
        await wait_until(lambda: sum(r.routable for r in coord.registry.nodes.values()) == 6, what="all admitted")
        await drive(coord, 30)
        honest_record = coord.registry.nodes[address(honest)]
        assert not honest_record.convicted, honest_record.evidence
        assert all(coord.registry.nodes[address(c)].convicted for c in colluders)
    finally:
        await coord.stop()


async def test_without_a_copy_colluders_get_the_block_contested_not_the_honest_convicted(
    family_dirs: list[Path], colluding_swarm: tuple[list[Proc], Proc, list[Proc]]
) -> None:
    """The coordinator runs member 1 (stem and head) and holds no copy of member 0, whose nodes it admits
    (non-strict): a disagreement on block 1 can be settled by nobody."""
    others, honest, colluders = colluding_swarm
    nodes = [*others, honest, *colluders]
    coord = coordinator(family_dirs[1], nodes, verify_on="peers", verify_rate=1.0, strict=False)
    await coord.start()
    try:
        await wait_until(lambda: sum(r.routable for r in coord.registry.nodes.values()) == 6, what="all admitted")
        await drive(coord, 20)
        assert not any(r.convicted for r in coord.registry.nodes.values())  # nobody's word convicts
        contested = coord.registry.contested_view()
        assert [c["block"] for c in contested] == [COLLUDED]
        assert not coord.registry.nodes[address(honest)].routable  # refused with the rest, not believed
        assert not any(coord.registry.nodes[address(c)].routable for c in colluders)
    finally:
        await coord.stop()


@pytest.fixture
def push_swarm(family_dirs: list[Path]) -> Iterator[tuple[list[Proc], Proc]]:
    honest = start_nodes([(family_dirs[0], 0), (family_dirs[0], 2)])
    liar = spawn_many([faulty(family_dirs[0], 1, "push")])[0]
    yield honest, liar
    stop_all([*honest, liar])


@pytest.mark.parametrize("decisive", [1, 0])
async def test_a_targeted_liar_is_caught_by_the_decisive_hop_check(
    family_dirs: list[Path], push_swarm: tuple[list[Proc], Proc], decisive: int
) -> None:
    honest, liar = push_swarm
    coord = coordinator(family_dirs[0], [*honest, liar], verify_rate=0.0, verify_probation=0, verify_decisive=decisive)
    await coord.start()
    try:
        await wait_until(lambda: len(coord.registry.routable_by_block()) == 3, what="all blocks routable")
        await drive(coord, 10)
        assert coord.registry.nodes[address(liar)].convicted is (decisive == 1)
    finally:
        await coord.stop()
