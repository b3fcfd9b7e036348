"""A swarm of real node processes on loopback, driven by an in-process coordinator.

Exact outputs, substitution across models, skipping, ejection and re-admission after SIGKILL, SIGSTOP
and restarts, and refusal of nodes that are not of the family.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, DepthError, Policy
from layerswarm.harness.procs import Proc, stop_all
from layerswarm.models.checkpoint import load_model, read_manifest

from ..conftest import make_model_dir
from ..swarm import address, coordinator, restart_node, start_nodes, states, wait_until

pytestmark = pytest.mark.slow
SEQ = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0)


@pytest.fixture
def two_models(family_dirs: list[Path]) -> Iterator[list[Proc]]:
    """Blocks 0..2 of member 0, then of member 1: every block index has two models behind it."""
    procs = start_nodes([(d, b) for d in family_dirs[:2] for b in range(3)])
    yield procs
    stop_all(procs)


@pytest.fixture
async def coord(family_dirs: list[Path], two_models: list[Proc]) -> AsyncIterator[Coordinator]:
    c = coordinator(family_dirs[0], two_models, family_dirs=tuple(family_dirs[1:]))
    await c.start()
    await wait_until(lambda: c.registry.reachable_depth() == 3, what="all blocks reachable")
    yield c
    await c.stop()


def node_of(procs: list[Proc], model_dir: Path, block: int) -> Proc:
    model_id = read_manifest(model_dir).model_id
    return next(p for p in procs if p.ready["model_id"] == model_id and p.ready["block"] == block)


async def test_sequential_path_equals_the_local_model(family_dirs: list[Path], two_models: list[Proc]) -> None:
    # A hop timeout far above any hop here: under a loaded CI one hop of the default 1 s ran out once and
    # member 1's block stood in (correct routing, but not what this test compares bit for bit).
    coord = coordinator(family_dirs[0], two_models, family_dirs=tuple(family_dirs[1:]), hop_timeout_s=30.0)
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == 3, what="all blocks reachable")
        torch.set_num_threads(1)
        model, manifest = load_model(family_dirs[0])
        images = torch.rand(3, 3, 16, 16)
        result = await coord.router.classify(images, SEQ)
    finally:
        await coord.stop()
    trace = [h.to_json() for h in [*result.path.hops, *result.path.discarded]]
    assert [h.block for h in result.path.hops] == [0, 1, 2], trace
    assert {h.model_id for h in result.path.hops} == {manifest.model_id}, trace  # own blocks first
    with torch.inference_mode():
        expected = model(images).softmax(-1)
    assert torch.equal(result.probs, expected)
    assert all(h.outcome == "ok" for h in result.path.hops)


async def test_shuffle_mixes_models_and_orders(coord: Coordinator) -> None:
    orders, models = set(), set()
    for seed in range(12):
        result = await coord.router.classify(
            torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SHUFFLE, seed=seed)
        )
        orders.add(tuple(h.block for h in result.path.hops))
        models |= {h.model_id for h in result.path.hops}
        assert sorted(h.block for h in result.path.hops) == [0, 1, 2]
    assert len(orders) > 2 and len(models) == 2


async def test_killed_node_is_substituted_then_ejected_then_readmitted_on_restart(
    coord: Coordinator, two_models: list[Proc], family_dirs: list[Path]
) -> None:
    victim = node_of(two_models, family_dirs[0], 1)
    await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)  # leaves a pooled stream to the victim behind
    victim.signal(signal.SIGKILL)
    victim.popen.wait(5)
    result = await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)
    hop = result.path.hops[1]
    assert hop.block == 1 and hop.model_id == read_manifest(family_dirs[1]).model_id  # the sibling stood in
    if hop.outcome == "substituted":  # the request found the victim dead itself
        assert hop.attempts[0].node == address(victim) and "UNAVAILABLE" in hop.attempts[0].error
    else:  # a health check (every 0.2 s) noticed first, so the victim was not planned at all: no race
        assert hop.outcome == "ok" and not hop.attempts
        assert states(coord)[address(victim)] != "healthy"
    await wait_until(lambda: states(coord)[address(victim)] == "ejected", what="ejection")
    result = await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)
    assert result.path.hops[1].outcome == "ok"  # ejected nodes are not even tried
    again = restart_node(family_dirs[0], 1, victim.ready["port"])
    two_models.append(again)
    await wait_until(lambda: states(coord)[address(victim)] == "healthy", what="re-admission")
    assert coord.registry.nodes[address(victim)].identity.boot_id == again.ready["boot_id"]  # type: ignore[union-attr]


async def test_frozen_node_times_out_is_ejected_and_readmitted(
    coord: Coordinator, two_models: list[Proc], family_dirs: list[Path]
) -> None:
    frozen = node_of(two_models, family_dirs[0], 2)
    frozen.signal(signal.SIGSTOP)
    try:
        result = await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)
        hop = result.path.hops[2]
        assert hop.outcome == "substituted" and "DEADLINE_EXCEEDED" in hop.attempts[0].error
        await wait_until(lambda: states(coord)[address(frozen)] == "ejected", what="ejection of a frozen node")
    finally:
        frozen.signal(signal.SIGCONT)
    await wait_until(lambda: states(coord)[address(frozen)] == "healthy", what="re-admission after SIGCONT")


async def test_block_with_no_node_left_is_skipped_or_replaced(family_dirs: list[Path], two_models: list[Proc]) -> None:
    # Slow health checks and lenient ejection: the executor itself must route around the dead nodes.
    c = coordinator(family_dirs[0], two_models, health_interval_s=60.0, eject_after=1000)
    await c.start()
    try:
        await wait_until(lambda: c.registry.reachable_depth() == 3)
        for d in family_dirs[:2]:
            node_of(two_models, d, 0).signal(signal.SIGKILL)
        full = await c.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SHUFFLE, seed=1))
        skipped = [h for h in full.path.hops if h.outcome == "skipped"]
        assert len(skipped) == 1 and skipped[0].planned_block == 0 and len(skipped[0].attempts) == 2
        assert full.path.depth == 2
        attempted = [a.node for h in full.path.hops for a in h.attempts]
        assert len(attempted) == len(set(attempted)) == 2  # a node that failed is not retried in the request
        replaced = []
        for seed in range(8):  # pruned to 2 blocks: a spare block index can stand in for block 0
            r = await c.router.classify(
                torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SHUFFLE, seed=seed, max_blocks=2)
            )
            assert r.path.depth == 2
            replaced += [h for h in r.path.hops if h.outcome == "substituted" and h.block != h.planned_block]
        assert replaced and all(h.planned_block == 0 and h.block in (1, 2) for h in replaced)
        seq = await c.router.classify(torch.rand(1, 3, 16, 16), SEQ)  # sequential never borrows another index
        assert [h.block for h in seq.path.hops] == [None, 1, 2]
        with pytest.raises(DepthError, match="minimum 3"):
            await c.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SHUFFLE, min_blocks=3))
    finally:
        await c.stop()


async def test_nodes_of_another_family_are_ignored(tmp_path: Path, family_dirs: list[Path]) -> None:
    stranger_dir = make_model_dir(tmp_path / "stranger", seed=99)
    procs = start_nodes([(family_dirs[0], 0), (stranger_dir, 1)])
    c = coordinator(family_dirs[0], procs)
    await c.start()
    try:
        await wait_until(lambda: "ignored" in states(c).values(), what="the stranger to be ignored")
        stranger = c.registry.nodes[address(procs[1])]
        assert "family" in stranger.reason and "not ours" in stranger.reason
        result = await c.router.classify(torch.rand(1, 3, 16, 16), SEQ)
        assert [h.block for h in result.path.hops] == [0] and result.path.unreachable == [1, 2]
    finally:
        await c.stop()
        stop_all(procs)


async def test_unvouched_weights_are_refused(tmp_path: Path, family_dirs: list[Path]) -> None:
    """A node serving a family member whose weights differ from that member's manifest is refused."""
    import shutil

    from layerswarm.models.checkpoint import Lineage, save_model

    forged = tmp_path / "forged"
    shutil.copytree(family_dirs[1], forged)
    model, manifest = load_model(forged)
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight.add_(1.0)
    save_model(model, forged, Lineage(**vars(manifest.lineage)))  # a new, self-consistent model id...
    raw = (forged / "manifest.json").read_text().replace(read_manifest(forged).model_id, manifest.model_id)
    (forged / "manifest.json").write_text(raw)  # ...relabelled as the genuine member: refuses to load
    procs = start_nodes([(family_dirs[0], 0)])
    c = coordinator(family_dirs[0], procs, family_dirs=(family_dirs[1],))
    try:
        assert c.registry.family.known_weights[(manifest.model_id, 0)] == manifest.block_sha256(0)
        from layerswarm.coordinator.membership.records import NodeIdentity

        c.registry.admit(
            "127.0.0.9:1",
            NodeIdentity(
                family_id=manifest.family_id,
                model_id=manifest.model_id,
                block=0,
                variant="layershuffle",
                weights_sha256="0" * 64,
                boot_id="b",
                protocol_version=1,
                depth=3,
                tokens=5,
                dim=32,
                shuffle_robust=True,
            ),
        )
        assert c.registry.nodes["127.0.0.9:1"].reason == "weights sha256 differs from the family manifest"
    finally:
        await c.stop()
        stop_all(procs)
    assert "model_id" in _load_error(forged)


def _load_error(path: Path) -> str:
    try:
        read_manifest(path)
    except ValueError as exc:
        return str(exc)
    return ""
