"""Rogue nodes, as real processes on loopback: each attack against the defence that stops it, and the
same attack with that defence switched off, so each test fails if its defence is removed.

The rogues are real node software (`python -m layerswarm.harness.faults`, `layerswarm node` on a forged
copy of a model directory) serving block 0 of the coordinator's own model, so that the sequential
policy asks them first. Honest nodes serve every block of a sibling member.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from layerswarm.coordinator import ClassifyOptions, Coordinator, Policy
from layerswarm.harness.faults import OVERFLOW_VALUE, forge_model_dir
from layerswarm.harness.procs import Proc, spawn, stop_all
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from ..swarm import address, coordinator, node_cmd, start_nodes, wait_until

SEQ = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0)


def rogue_cmd(model_dir: Path, block: int, mode: str, *extra: str, port: int = 0) -> list[str]:
    args = node_cmd(model_dir, block, "--no-advertise", port=port)[4:]  # drop `python -m layerswarm node`
    return [sys.executable, "-m", "layerswarm.harness.faults", *args, "--fault-mode", mode, *extra]


@pytest.fixture(scope="module")
def honest(family_dirs: list[Path]) -> Iterator[list[Proc]]:
    procs = start_nodes([(family_dirs[1], b) for b in range(3)])
    yield procs
    stop_all(procs)


@pytest.fixture
def rogue(request: pytest.FixtureRequest, family_dirs: list[Path]) -> Iterator[Proc]:
    mode, *extra = request.param
    proc = spawn(f"rogue-{mode}", rogue_cmd(family_dirs[0], 0, mode, *extra))
    yield proc
    stop_all([proc])


async def started(family_dirs: list[Path], nodes: list[Proc], **overrides: object) -> Coordinator:
    values = {"wire_dtype": "fp16", **overrides}
    coord = coordinator(family_dirs[0], nodes, family_dirs=tuple(family_dirs[1:]), **values)
    await coord.start()
    await wait_until(lambda: len(coord.registry.routable_by_block()) == 3, what="all blocks routable")
    await wait_until(lambda: all(r.routable for r in coord.registry.nodes.values()), what="every node admitted")
    return coord


@pytest.mark.parametrize("rogue", [("zeros",), ("noise",), ("other-block",)], indirect=True)
async def test_lying_node_is_quarantined_on_evidence(family_dirs: list[Path], honest: list[Proc], rogue: Proc) -> None:
    coord = await started(family_dirs, [*honest, rogue])
    try:
        result = await coord.router.classify(torch.rand(2, 3, 16, 16), SEQ)
        hop = result.path.hops[0]
        assert hop.outcome == "substituted" and hop.node == address(honest[0])
        assert "verification failed" in hop.attempts[0].error
        view = {n["address"]: n for n in coord.registry.snapshot()}[address(rogue)]
        assert view["state"] == "quarantined"
        evidence = view["evidence"][0]
        assert evidence["check"] == "re-execution"
        assert "verified copy" in evidence["against"] and evidence["hops_before_detection"] == 1
        assert float(evidence["discrepancy"].rsplit(" ", 1)[-1]) > evidence["tolerance"]
        for _ in range(3):  # a node quarantined on evidence is never asked again
            hops = (await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)).path.hops
            assert address(rogue) not in {h.node for h in hops}
        # What an operator alerts on: the conviction and the transition, on /metrics.
        scraped = generate_latest(coord.metrics.registry).decode()
        assert "layerswarm_verify_convictions_total 1.0" in scraped
        assert 'layerswarm_node_transitions_total{to="quarantined"} 1.0' in scraped
        assert 'layerswarm_verify_hops_total{kind="reexecuted"}' in scraped
    finally:
        await coord.stop()


async def test_a_convicted_node_restarting_with_a_new_boot_id_stays_out(
    family_dirs: list[Path], honest: list[Proc]
) -> None:
    """The boot id is the node's own claim: a liar that restarts (or just claims a new boot id) stays
    quarantined for the conviction's cool-down instead of being back after its probation hops."""
    rogue = spawn("rogue-zeros", rogue_cmd(family_dirs[0], 0, "zeros"))
    coord = await started(family_dirs, [*honest, rogue])
    try:
        await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)  # on probation: caught on its first hop
        record = coord.registry.nodes[address(rogue)]
        assert record.convicted and record.identity is not None
        convicted_boot, port, served = record.identity.boot_id, int(rogue.ready["port"]), record.served
        stop_all([rogue])
        # Back with a new boot id, honest for its probation hops and lying after: the attack.
        rogue = spawn("rogue-again", rogue_cmd(family_dirs[0], 0, "zeros", "--fault-after", "2", port=port))
        await wait_until(
            lambda: record.identity is not None and record.identity.boot_id != convicted_boot,
            what="the restarted rogue's Info",
        )
        for seed in range(4):  # several health rounds and requests later: never asked
            hops = (
                await coord.router.classify(
                    torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL, seed=seed)
                )
            ).path.hops
            assert address(rogue) not in {h.node for h in hops} | {a.node for h in hops for a in h.attempts}
        assert record.served == served
        assert record.state.value == "quarantined" and "new boot id" in record.reason
        view = {n["address"]: n for n in coord.registry.snapshot()}[address(rogue)]
        assert view["convictions"] == 1 and view["barred_until"] > time.time()
        scraped = generate_latest(coord.metrics.registry).decode()  # a refused comeback is no transition
        assert 'layerswarm_node_transitions_total{to="quarantined"} 1.0' in scraped
        assert "layerswarm_verify_convictions_total 1.0" in scraped
    finally:
        await coord.stop()
        stop_all([rogue])


@pytest.mark.parametrize("rogue", [("zeros",)], indirect=True)
async def test_without_verification_the_liar_is_used(family_dirs: list[Path], honest: list[Proc], rogue: Proc) -> None:
    coord = await started(family_dirs, [*honest, rogue], verify_rate=None)
    try:
        hop = (await coord.router.classify(torch.rand(2, 3, 16, 16), SEQ)).path.hops[0]
        assert hop.outcome == "ok" and hop.node == address(rogue)  # well-formed: nothing else notices
        assert coord.registry.nodes[address(rogue)].routable
    finally:
        await coord.stop()


@pytest.mark.parametrize("rogue", [("zeros", "--fault-after", "2")], indirect=True)
async def test_a_node_that_turns_after_probation_is_caught_by_sampling(
    family_dirs: list[Path], honest: list[Proc], rogue: Proc
) -> None:
    # A generous health timeout: on a loaded machine a slow health answer could eject the rogue before
    # sampling convicts it, and this test is about the conviction.
    coord = await started(family_dirs, [*honest, rogue], verify_rate=0.5, verify_probation=2, health_timeout_s=5.0)
    try:
        for seed in range(40):
            await coord.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL, seed=seed))
            if coord.registry.nodes[address(rogue)].convicted:
                break
        record = coord.registry.nodes[address(rogue)]
        assert record.state.value == "quarantined" and record.convicted
        assert record.evidence[0]["hops_before_detection"] > 2  # passed probation honestly, then lied
        for seed in range(8):  # honest hops after probation: about half are re-executed, not all
            await coord.router.classify(
                torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL, seed=100 + seed)
            )
        stats = coord.verifier.stats() if coord.verifier else {}
        assert 0 < stats["hops_reexecuted"] < stats["hops_seen"]  # sampled, not every hop
    finally:
        await coord.stop()


@pytest.mark.parametrize("rogue", [("overflow",)], indirect=True)
@pytest.mark.parametrize("verify", [0.05, None])
async def test_overflowing_sender_is_blamed_not_the_next_hop(
    family_dirs: list[Path], honest: list[Proc], rogue: Proc, verify: float | None
) -> None:
    coord = await started(family_dirs, [*honest, rogue], verify_rate=verify)
    try:
        result = await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)
        assert result.path.hops[0].outcome == "substituted"
        liar = coord.registry.nodes[address(rogue)]
        assert liar.state.value == "quarantined" and liar.evidence[0]["check"] == "hard range"
        for proc in honest:  # the hops after it saw honest input: no failure counted against them
            record = coord.registry.nodes[address(proc)]
            assert record.routable and record.failed == 0
    finally:
        await coord.stop()


@pytest.mark.parametrize("rogue", [("runtime-overflow",)], indirect=True)
async def test_node_refuses_to_send_out_of_range_output(rogue: Proc) -> None:
    async with grpc.aio.insecure_channel(address(rogue)) as channel:
        reply = pb_grpc.BlockNodeStub(channel).Forward(
            pb.ForwardRequest(activations=codec.encode(torch.randn(1, 5, 32), torch.float16), position=0)
        )
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await reply
    assert exc.value.code() is grpc.StatusCode.INTERNAL and "out of range for float16" in (exc.value.details() or "")


async def test_node_blames_an_out_of_range_input_on_its_sender(honest: list[Proc]) -> None:
    x = torch.full((1, 5, 32), OVERFLOW_VALUE)
    async with grpc.aio.insecure_channel(address(honest[1])) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await pb_grpc.BlockNodeStub(channel).Forward(
                pb.ForwardRequest(activations=codec.encode(x, torch.float16), position=1)
            )
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "input activations out of range" in (exc.value.details() or "")


@pytest.fixture(scope="module")
def forger(family_dirs: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    # A heavy edit: the test family's members differ a lot from each other, and an unlisted model is
    # judged against that spread (coordinator/verify.py); strict mode needs no such margin.
    forged = forge_model_dir(family_dirs[0], tmp_path_factory.mktemp("forged") / "m0-forged", scale=3.0)
    proc = spawn("forger", node_cmd(forged, 0, "--no-advertise"))  # genuine node software
    yield proc
    stop_all([proc])


async def test_strict_mode_refuses_forged_weights(family_dirs: list[Path], honest: list[Proc], forger: Proc) -> None:
    coord = coordinator(family_dirs[0], [*honest, forger], family_dirs=tuple(family_dirs[1:]))
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.nodes[address(forger)].identity is not None, what="forger's Info")
        record = coord.registry.nodes[address(forger)]
        assert record.state.value == "ignored" and "listed by no known manifest" in record.reason
        assert record.identity is not None and record.identity.family_id == coord.manifest.family_id  # same family
    finally:
        await coord.stop()


@pytest.mark.parametrize("verify", [0.05, None])
async def test_non_strict_mode_catches_forged_weights_by_verification(
    family_dirs: list[Path], honest: list[Proc], forger: Proc, verify: float | None
) -> None:
    coord = await started(family_dirs, [*honest, forger], strict=False, verify_rate=verify)
    try:
        for seed in range(30):  # the forger and the honest node share block 0: until it is asked
            await coord.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SHUFFLE, seed=seed))
            if coord.registry.nodes[address(forger)].served or not coord.registry.nodes[address(forger)].routable:
                break
        record = coord.registry.nodes[address(forger)]
        if verify is None:
            assert record.routable and record.served > 0  # admitted and used: only verification stops it
        else:
            assert record.state.value == "quarantined"
            assert "family members" in record.evidence[0]["against"]
    finally:
        await coord.stop()


async def test_int8_wire_answers_like_fp32_and_honest_nodes_pass_every_check(
    family_dirs: list[Path], honest: list[Proc]
) -> None:
    """The compact wire: int8 both ways, verified on every hop without blaming an honest node."""
    x = torch.rand(4, 3, 16, 16)
    answers = {}
    for wire in ("fp32", "int8"):
        coord = await started(family_dirs, honest, wire_dtype=wire, verify_rate=1.0)
        try:
            result = await coord.router.classify(x, SEQ)
            assert all(h.outcome == "ok" for h in result.path.hops)
            assert all(r.state.value == "healthy" and not r.evidence for r in coord.registry.nodes.values())
            stats = coord.verifier.stats() if coord.verifier else {}
            assert stats["hops_reexecuted"] == stats["hops_seen"] > 0
            answers[wire] = result.probs
        finally:
            await coord.stop()
    assert torch.allclose(answers["int8"], answers["fp32"], atol=0.05)
    assert not torch.equal(answers["int8"], answers["fp32"])  # it really travelled as int8
