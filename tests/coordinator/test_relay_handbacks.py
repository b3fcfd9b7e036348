"""A relay hand-back is a claim about the next node, not evidence: the coordinator routes around the
named node for that request and probes it itself; the probe, never the claim, decides whether the
named node failed, and how it turned out counts for the node that claimed it (docs/relay.md, "Blame")."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest

from layerswarm.coordinator import Classification, Coordinator
from layerswarm.coordinator.membership.claims import Claims
from layerswarm.coordinator.membership.records import FamilySpec, NodeState
from layerswarm.coordinator.membership.registry import Registry
from layerswarm.coordinator.relay.handbacks import HandbackReferee, forward_probe
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.wire import codec
from layerswarm.wire.trace_sign import rest_digest
from layerswarm.wire.v1 import block_pb2 as pb

from ..relay_lab import SEQ, images, in_process_relay_swarm, tampering_onward

REPLICATED = [0, 1, 1, 2]  # two nodes serve block 1: a request answers in full without either of them
RETRY = pb.ForwardRequest(request_id="r-probe")  # what a unit test's fake probe is handed


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_contradicted_claims_in_a_row_make_a_node_end_chains_only_for_a_while() -> None:
    clock = Clock()
    claims = Claims(clock, strikes=3, bar_s=60.0)
    assert claims.may_forward("a:1")
    assert not claims.contradicted("a:1") and not claims.contradicted("a:1")
    claims.confirmed("a:1")  # a claim that held up starts the count again
    assert not claims.contradicted("a:1") and not claims.contradicted("a:1")
    claims.disputed("a:1", "b:2")  # no strike: which of the two lied is not known
    assert claims.contradicted("a:1")  # the third in a row
    assert not claims.may_forward("a:1") and claims.may_forward("b:2")
    view = claims.view("a:1", wall=lambda: 5000.0)
    assert view == {
        "handbacks_confirmed": 1,
        "handbacks_contradicted": 5,
        "handbacks_disputed": 1,
        "handbacks_contradicted_in_a_row": 0,
        "chain_end_only_until": 5060.0,
    }
    clock.now += 60.0
    assert claims.may_forward("a:1") and claims.view("a:1", lambda: 0.0)["chain_end_only_until"] is None


def test_claims_are_bounded_keeping_the_nodes_barred_longest() -> None:
    clock = Clock()
    claims = Claims(clock, strikes=1, bar_s=60.0, max_keys=3)
    assert claims.contradicted("barred:1")
    claims.confirmed("a:1")
    claims.confirmed("b:2")
    claims.confirmed("c:3")  # full: one never barred makes room
    assert len(claims) == 3 and not claims.may_forward("barred:1") and claims.get("c:3") is not None


def _referee(probe: Any, timeout_s: float = 1.0, max_probes: int = 8) -> tuple[Registry, HandbackReferee, list[str]]:
    registry = Registry(FamilySpec("f", 3, 5, 32))
    for address in ("a:1", "b:2", "c:3"):
        registry.add_candidate(address, "static")
    outcomes: list[str] = []
    return registry, HandbackReferee(registry, probe, timeout_s, outcomes.append, max_probes), outcomes


async def test_claims_against_a_node_being_probed_wait_for_that_probe() -> None:
    calls: list[str] = []
    release = asyncio.Event()

    async def probe(address: str, request: pb.ForwardRequest) -> bool:
        calls.append(address)
        await release.wait()
        return True  # it answers: both claims are contradicted

    registry, referee, outcomes = _referee(probe)
    referee.claim("a:1", "b:2", RETRY)
    referee.claim("c:3", "b:2", RETRY)
    await asyncio.sleep(0)
    assert referee.probing == {"b:2"}
    release.set()
    await referee.wait()
    assert calls == ["b:2"] and outcomes == ["contradicted", "contradicted"]
    assert all(registry.claims.get(a).contradicted == 1 for a in ("a:1", "c:3"))  # type: ignore[union-attr]
    assert referee.probing == frozenset()


async def test_a_probe_that_does_not_answer_in_time_counts_against_the_named_node() -> None:
    async def hanging(address: str, request: pb.ForwardRequest) -> bool:
        await asyncio.sleep(3600)
        return True

    registry, referee, outcomes = _referee(hanging, timeout_s=0.05)
    referee.claim("a:1", "b:2", RETRY)
    await referee.wait()
    assert outcomes == ["confirmed"] and registry.claims.get("a:1").confirmed == 1  # type: ignore[union-attr]
    assert (registry.nodes["b:2"].failed, registry.nodes["b:2"].consecutive_failures) == (1, 1)


async def test_a_probe_that_fails_is_logged_and_the_next_claim_probes_again(caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    async def broken(address: str, request: pb.ForwardRequest) -> bool:
        nonlocal calls
        calls += 1
        raise RuntimeError("a bug in the probe")

    registry, referee, outcomes = _referee(broken)
    with caplog.at_level(logging.ERROR, logger="layerswarm.coordinator.relay.handbacks"):
        referee.claim("a:1", "b:2", RETRY)
        await referee.wait()
        await asyncio.sleep(0)  # the done callback runs after the task
    assert any("hand-back probe b:2 failed" in r.message and r.exc_info for r in caplog.records)
    assert outcomes == ["unchecked"] and registry.claims.get("a:1") is None
    referee.claim("a:1", "b:2", RETRY)
    await referee.wait()
    assert calls == 2


async def test_claims_past_the_probe_limit_are_left_unchecked() -> None:
    release = asyncio.Event()

    async def probe(address: str, request: pb.ForwardRequest) -> bool:
        await release.wait()
        return False

    _, referee, outcomes = _referee(probe, max_probes=1)
    referee.claim("a:1", "b:2", RETRY)
    referee.claim("a:1", "c:3", RETRY)  # a second node while the first is probed: over the limit
    referee.claim("a:1", "gone:9", RETRY)  # not in the registry
    assert outcomes == ["unchecked", "unchecked"]
    release.set()
    await referee.wait()
    assert outcomes[-1] == "confirmed"
    await referee.close()


def _handing_back_falsely(node: FaultyNode) -> None:
    """Make `node` hand back every chain it does not end, claiming its next node failed, without ever
    contacting it. Its own entry is signed as an honest hand-back's (node/relay.py does that)."""

    async def false_claim(request: pb.RelayRequest, reply: pb.ForwardResponse, own: pb.HopTrace, *_: Any) -> Any:
        nxt = request.chain[request.index + 1]
        reason = f"step {request.index + 1} ({nxt.address}, block {nxt.block}): UNAVAILABLE: made up"
        rid = request.forward.request_id
        own.rest_sha256 = rest_digest((), rid, request.plan_mac)  # as node/relay.py's own hand-back
        return pb.RelayEvent(request_id=rid, trace=[own], activations=reply.activations, handback_reason=reason)

    node.relayer._forward = false_claim  # type: ignore[method-assign]


def _answers_in_full(result: Classification, reference: Classification) -> None:
    assert result.path.depth == 3, result.path.hops
    assert torch.allclose(result.probs, reference.probs, atol=1e-6)


async def _classify(coord: Coordinator) -> Classification:
    """One request, then the hand-back probes it started (they never hold the request up)."""
    result = await coord.router.classify(images(), SEQ)
    await coord.handbacks.wait()
    return result


async def test_a_node_falsely_blaming_its_successor_gets_it_neither_failed_nor_ejected(tmp_path: Path) -> None:
    """Before, a node that handed back on every chain naming its honest successor had that successor's
    failure recorded each time: ejected after two requests, on nothing but its word. Now the successor
    is only avoided for the request (its replica serves), the coordinator's probe finds it answering, the
    claims count as contradicted against the claimer, and after three in a row the claimer only ends
    chains (here it is the first step: it runs star), so it cannot claim again."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 4, blocks=REPLICATED, verify_rate=None, min_blocks=1
    )
    addresses = [f"127.0.0.1:{n.port}" for n in served]
    claimer, successors = addresses[0], addresses[1:3]
    try:
        reference = await _classify(coord)
        assert not reference.path.handbacks and [h.outcome for h in reference.path.hops] == ["relayed"] * 3
        _handing_back_falsely(served[0])
        results = [await _classify(coord) for _ in range(5)]
        for result in results:
            _answers_in_full(result, reference)
        assert [len(r.path.handbacks) for r in results] == [1, 1, 1, 0, 0]
        assert [r.path.hops[0].outcome for r in results[3:]] == ["ok", "ok"]  # its hop went star
        for successor in successors:
            record = coord.registry.nodes[successor]
            assert (record.failed, record.consecutive_failures, record.state) == (0, 0, NodeState.HEALTHY)
        (view,) = [v for v in coord.registry.snapshot() if v["address"] == claimer]
        assert view["handbacks_contradicted"] == 3 and view["handbacks_confirmed"] == 0
        assert view["chain_end_only_until"] is not None
        scraped = generate_latest(coord.metrics.registry).decode()
        assert 'layerswarm_relay_handbacks_total{outcome="contradicted"} 3.0' in scraped
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_dead_successor_is_confirmed_by_the_probe_and_ejected(tmp_path: Path) -> None:
    """The successor really is dead: the hand-back routes around it at once, the coordinator's own
    forward of the handed-back activation to it fails and counts against it (as a star hop's would), so
    it is ejected after `eject_after` (2) probes, on the coordinator's own observation; the claims count
    as confirmed."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 4, blocks=REPLICATED, verify_rate=None, min_blocks=1
    )
    addresses = [f"127.0.0.1:{n.port}" for n in served]
    running = list(served)
    try:
        reference = await _classify(coord)
        dead = reference.path.hops[1].node
        await running.pop(addresses.index(dead)).stop()
        for expected_failures in (1, 2):
            result = await _classify(coord)
            _answers_in_full(result, reference)
            (handback,) = result.path.handbacks
            assert dead in handback["reason"] and result.path.hops[1].node != dead
            assert coord.registry.nodes[dead].consecutive_failures == expected_failures
        record = coord.registry.nodes[dead]
        assert record.state is NodeState.EJECTED and record.reason.startswith("forward after a hand-back: UNAVAILABLE")
        assert coord.registry.claims.get(addresses[0]).confirmed == 2  # type: ignore[union-attr]
        after = await _classify(coord)  # the dead node is out of the plan: no hand-back left
        _answers_in_full(after, reference)
        assert not after.path.handbacks and [h.outcome for h in after.path.hops] == ["relayed"] * 3
        scraped = generate_latest(coord.metrics.registry).decode()
        assert 'layerswarm_relay_handbacks_total{outcome="confirmed"} 2.0' in scraped
    finally:
        await coord.stop()
        for node in running:
            await node.stop()


class _Answering:
    """A client pool whose every node answers the coordinator's forward with `reply`."""

    def __init__(self, reply: torch.Tensor) -> None:
        self.reply = reply

    def get(self, address: str) -> _Answering:
        return self

    async def forward(self, request: pb.ForwardRequest, timeout: float) -> pb.ForwardResponse:
        return pb.ForwardResponse(request_id=request.request_id, activations=codec.encode(self.reply))


@pytest.mark.parametrize(
    ("reply", "answered"),
    [
        (torch.randn(1, 5, 32), True),
        (torch.full((1, 5, 32), float("nan")), False),  # in time, but not a block's output
        (torch.randn(1, 4, 32), False),
    ],
)
async def test_only_a_well_formed_answer_contradicts_a_claim(reply: torch.Tensor, answered: bool) -> None:
    """Before, any answer in time contradicted the claim: a successor answering the coordinator's probe
    with NaNs or a wrong shape cleared itself and counted against the honest node that handed back."""
    registry = Registry(FamilySpec("f", 3, 5, 32))
    registry.add_candidate("b:2", "static")
    probe = forward_probe(registry, _Answering(reply), hop_timeout_s=1.0)  # type: ignore[arg-type]
    request = pb.ForwardRequest(request_id="r-probe", activations=codec.encode(torch.randn(1, 5, 32)), position=1)
    assert await probe("b:2", request) is answered
    record = registry.nodes["b:2"]
    assert (record.state is NodeState.QUARANTINED) is not answered
    assert answered or "malformed activations" in record.reason


async def test_a_node_shortening_its_successors_deadline_is_kept_apart_from_it_and_bars_nobody(tmp_path: Path) -> None:
    """Before, a node could shorten the deadline it passes on (it is not in the chain's MAC: it shrinks
    at every hop) and the honest next node handed back against its honest successor on every chain:
    contradicted each time, so after three it could only end chains, on a lie told by the node before
    it, which went free. Now every node signs the limits it was given into its trace entry and the
    coordinator holds them against its own clock: such a claim is not probed (the named node is only
    left out of that request: its replica serves), and since the coordinator cannot tell whether the
    shortener or its successor lied, the two are disputed: never adjacent in a chain for a while, so the
    shortener cannot shorten that node's limits again. Nobody is barred; every request answers in full."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 4, blocks=[0, 1, 2, 2], verify_rate=None, min_blocks=1
    )
    shortener, victim = (f"127.0.0.1:{n.port}" for n in served[:2])
    try:
        reference = await _classify(coord)
        assert not reference.path.handbacks and [h.outcome for h in reference.path.hops] == ["relayed"] * 3
        named = reference.path.hops[2].node
        # 1 us: no chain can finish in it (2 ms could: a tiny model's hops on loopback, and it passed)
        tampering_onward(served[0], lambda request: setattr(request, "deadline_s", 1e-6))
        result = await _classify(coord)
        _answers_in_full(result, reference)
        (handback,) = result.path.handbacks
        assert f"({named}, block 2): DEADLINE_EXCEEDED" in handback["reason"], handback
        assert f"step 1 ({victim}): it was given 1e-06 s" in handback["discounted"], handback
        assert not coord.registry.claims.may_follow(shortener, victim)
        for _ in range(2):  # the shortener's step runs star; the victim starts the chain and forwards
            after = await _classify(coord)
            _answers_in_full(after, reference)
            assert not after.path.handbacks and [h.outcome for h in after.path.hops] == ["ok", "relayed", "relayed"]
        for address in (shortener, victim):
            tally = coord.registry.claims.get(address)
            assert tally is not None and (tally.disputed, tally.contradicted) == (1, 0)
            assert coord.registry.claims.may_forward(address)
        assert coord.registry.nodes[named].failed == 0
        scraped = generate_latest(coord.metrics.registry).decode()
        assert 'layerswarm_relay_handbacks_total{outcome="discounted"} 1.0' in scraped
        assert 'outcome="contradicted"' not in scraped
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


def test_the_limits_a_claimer_was_given_are_held_against_the_coordinators_clock() -> None:
    """Step k's deadline, from when it arrived, ends no earlier than the chain's less k hand-back
    margins; it arrived before the hand-back reached us. The hop timeout passes on unchanged."""
    from layerswarm.coordinator.relay.handbacks import given_times_problem

    sent = pb.RelayRequest(hop_timeout_s=2.0, deadline_s=10.0)
    honest = pb.HopTrace(given_hop_timeout_s=2.0, given_deadline_s=10.0 - 0.25 - 0.5)  # after 0.5 s at step 1
    assert given_times_problem(honest, sent, step=1, waited_s=0.5) is None
    assert given_times_problem(honest, sent, step=1, waited_s=0.1) is not None  # not yet that far in
    late = pb.HopTrace(given_hop_timeout_s=2.0, given_deadline_s=0.001)  # the floor, once time ran out
    assert given_times_problem(late, sent, step=3, waited_s=9.5) is None
    shortened = pb.HopTrace(given_hop_timeout_s=0.001, given_deadline_s=10.0)
    assert "hop timeout of 0.001 s" in (given_times_problem(shortened, sent, step=1, waited_s=0.5) or "")


async def test_a_shortener_two_hops_back_is_the_one_disputed(tmp_path: Path) -> None:
    """Hostile step 0 passes step 1 a short (but not instantly fatal) deadline. Honest step 1 computes
    and passes on what is left, less its margin, as every honest node does. Honest step 2 then cannot
    wait out its honest (merely slowish, 0.6 s < hop timeout) next node and hands back. Checking only
    the claimer's entry struck steps 2 and 1, both honest, and never the shortener: every entry is
    checked, and the first with shortened limits (step 1) is disputed with the node before it."""
    slow = FaultSpec(delay_ms=600.0)
    served, coord = await in_process_relay_swarm(
        tmp_path,
        [FaultSpec(), FaultSpec(), FaultSpec(), slow, slow],
        blocks=[0, 1, 2, 3, 3],
        verify_rate=None,
        min_blocks=1,
    )
    shortener, honest1, honest2 = (f"127.0.0.1:{n.port}" for n in served[:3])
    try:
        reference = await coord.router.classify(images(), SEQ)
        assert not reference.path.handbacks and [h.outcome for h in reference.path.hops] == ["relayed"] * 4
        tampering_onward(served[0], lambda request: setattr(request, "deadline_s", 0.3))
        for _ in range(3):
            result = await coord.router.classify(images(), SEQ)
            await coord.handbacks.wait()
            assert result.path.depth == 4
        claims = coord.registry.claims
        struck = {a: (claims.get(a).disputed if claims.get(a) else 0) for a in (shortener, honest1, honest2)}
        barred = {a: not claims.may_forward(a) for a in (shortener, honest1, honest2)}
        # What must hold: honest nodes are not barred on the shortener's lie, and the shortener pays.
        assert not barred[honest1] and not barred[honest2], (struck, barred)
        assert struck[shortener] > 0, struck
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_longer_hop_timeout_passed_on_discounts_no_claim(tmp_path: Path) -> None:
    """Hostile step 0 passes on a hop timeout 1 us longer than the chain's: no effect on any wait. When a
    later honest node (step 2) honestly hands back against a node that really died (step 3), an exact
    comparison discounted the claim: the dead node was never probed and honest nodes took strikes. Only
    a shorter limit can make an honest node time out early, so only a shorter one is held against it."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 5, blocks=[0, 1, 2, 3, 3], verify_rate=None, min_blocks=1
    )
    addresses = [f"127.0.0.1:{n.port}" for n in served]
    running = list(served)
    try:
        reference = await coord.router.classify(images(), SEQ)
        assert [h.outcome for h in reference.path.hops] == ["relayed"] * 4
        dead = reference.path.hops[3].node
        await running.pop(addresses.index(dead)).stop()
        tampering_onward(served[0], lambda request: setattr(request, "hop_timeout_s", request.hop_timeout_s + 1e-6))
        for _ in range(2):
            result = await coord.router.classify(images(), SEQ)
            await coord.handbacks.wait()
            assert result.path.depth == 4
        claims = coord.registry.claims
        honest = addresses[1:3]
        assert all((claims.get(a).disputed if claims.get(a) else 0) == 0 for a in honest), [
            claims.get(a) for a in honest
        ]
        assert coord.registry.nodes[dead].failed >= 1  # the coordinator's own probe would have seen it dead
    finally:
        await coord.stop()
        for node in running:
            await node.stop()


def test_liars_about_their_own_limits_never_bar_their_honest_predecessor() -> None:
    """Striking both nodes of a dispute let two hostile replicas of the block after honest P each lie
    about their own limits twice (2 < 3 strikes: neither barred) while P, who told no lie, took 4 and
    only ended chains. A dispute now keeps the two apart and strikes nobody."""
    registry = Registry(FamilySpec("f", 3, 5, 32))

    async def probe(*_: object) -> bool:  # pragma: no cover - a discounted claim is never probed
        return True

    referee = HandbackReferee(registry, probe, 1.0, lambda outcome: None, 8)
    for hostile in ("h1:1", "h2:2"):
        for _ in range(2):
            referee.discount(hostile, "n:3", ("p:0", hostile), "it was given 0.001 s for the rest of the chain")
    assert all(registry.claims.may_forward(a) for a in ("p:0", "h1:1", "h2:2"))
    assert not registry.claims.may_follow("p:0", "h1:1") and not registry.claims.may_follow("p:0", "h2:2")
    assert registry.claims.may_follow("h1:1", "p:0")  # in that order only
    referee.discount("f:4", "n:3", (None, "f:4"), "it was given 0.001 s")  # the coordinator gave it its limits
    assert registry.claims.get("f:4").contradicted == 1  # type: ignore[union-attr]  # its own lie


def _silent_after_acknowledging(node: FaultyNode) -> None:
    """`node` acknowledges its step of a chain, then never sends its final event: what its caller sees
    when it loses power or its link right after the acknowledgement (no connection reset)."""
    relay = node.relayer.relay

    async def silent(request: pb.RelayRequest, handle: Any) -> Any:
        async for event in relay(request, handle):
            yield event
            if event.ack:
                await asyncio.sleep(3600)

    node.relayer.relay = silent  # type: ignore[method-assign]


def _collect_never_answers(node: FaultyNode) -> None:
    """`node` ends its chains as ever (acknowledgement and final event back along the chain) but its
    result never reaches the coordinator's Collect: its link went down right after."""

    async def never(*_: Any) -> None:
        await asyncio.sleep(3600)

    node.relayer.collect = never  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("blocks", "silent_hop", "make_silent"),
    [
        ([0, 0, 1, 2], 0, _silent_after_acknowledging),
        (REPLICATED, 1, _silent_after_acknowledging),
        ([0, 1, 2, 2], 2, _collect_never_answers),
    ],
    ids=["first-node-after-its-ack", "middle-node-after-its-ack", "last-node-collect"],
)
async def test_a_node_gone_silent_mid_chain_costs_hop_timeouts_not_the_deadline(
    tmp_path: Path, blocks: list[int], silent_hop: int, make_silent: Any
) -> None:
    """A node that goes silent inside a chain after acknowledging (or, ending it, whose result never
    reaches the Collect) is handed back within the chain's hop timeouts (wire/relay_plan.rest_wait_s),
    and the request answers in full on the block's other node. Before, the wait for the rest of the
    chain, and for the Collect, ran to the request's deadline (here 20 s), which a home LAN test saw as
    a request failed when a board lost power under load."""
    served, coord = await in_process_relay_swarm(
        tmp_path,
        [FaultSpec()] * 4,
        blocks=blocks,
        verify_rate=None,
        min_blocks=1,
        hop_timeout_s=0.5,
        request_timeout_s=20.0,
    )
    addresses = [f"127.0.0.1:{n.port}" for n in served]
    try:
        reference = await _classify(coord)
        silent = reference.path.hops[silent_hop].node
        make_silent(served[addresses.index(silent)])
        started = asyncio.get_running_loop().time()
        result = await coord.router.classify(images(), SEQ)
        elapsed = asyncio.get_running_loop().time() - started
        _answers_in_full(result, reference)
        assert result.path.handbacks and silent not in {h.node for h in result.path.hops}, result.path.handbacks
        assert "DEADLINE_EXCEEDED" in str(result.path.handbacks) or silent_hop == 2
        if silent_hop == 2:  # discarded at once, not after a second Collect on the silent node
            assert "did not come within a hop timeout" in str(result.path.handbacks), result.path.handbacks
        assert elapsed < 4.0, (elapsed, result.path.handbacks)  # a few hop timeouts of 0.5 s, not 20 s
    finally:
        await coord.stop()
        for node in served:
            await node.stop()
