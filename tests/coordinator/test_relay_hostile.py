"""Relay chains against lying or misbehaving nodes: impossible times, rewritten trace entries, lying
acknowledgements, chains ended early, calls that talk on or stall. Each is blamed on the node that did it."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from layerswarm.coordinator import Coordinator, NodeClient
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.auth import derive_key
from layerswarm.wire.relay_plan import digest, plan_mac
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb

from ..conftest import make_model_dir
from ..relay_lab import SEQ, TOKEN, images, in_process_relay_swarm, running_the_last_step_first, tampering_onward
from ..swarm import wait_until


@pytest.mark.parametrize(
    ("field", "value"),
    [("rtt_ms", float("nan")), ("rtt_ms", -1.0), ("rtt_ms", 1e9), ("send_ms", float("inf")), ("compute_ms", -5.0)],
)
def test_a_trace_with_impossible_times_is_refused(field: str, value: float) -> None:
    """A lying node's figures never reach the link map: NaN, negative or absurd times void the chain."""
    from types import SimpleNamespace

    from layerswarm.coordinator.relay.chain_trace import trace_problem
    from layerswarm.wire.relay_plan import digest

    chain = [pb.RelayStep(address="a:1", position=0, block=0), pb.RelayStep(address="b:2", position=1, block=1)]
    sent = pb.RelayRequest(forward=pb.ForwardRequest(activations=pb.Tensor(data=b"activations")), chain=chain)
    segment = [(None, SimpleNamespace(address=s.address, block=s.block, identity=None)) for s in chain]
    first = pb.HopTrace(node="a:1", block=0, position=0, compute_ms=1.0, send_ms=2.0, rtt_ms=0.5)
    first.input_sha256, first.output_sha256 = digest(b"activations"), "out-a"
    second = pb.HopTrace(node="b:2", block=1, position=1, compute_ms=1.0, input_sha256="out-a", output_sha256="out-b")
    assert trace_problem([first, second], segment, sent) is None  # type: ignore[arg-type]
    setattr(first, field, value)
    problem = trace_problem([first, second], segment, sent)  # type: ignore[arg-type]
    assert problem == (0, "trace step 0 (a:1): it has impossible times", 0)  # its own entry: it alone


async def test_a_stopping_node_ends_its_idle_relay_streams_instead_of_waiting_out_its_grace(tmp_path: Path) -> None:
    """Relay streams live as long as their sender: a node draining on SIGTERM must not wait its whole
    grace period for them. It finishes the chains in flight, closes each stream, and the coordinator's
    next request goes on without it."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 3, node_values={"grace_s": 30.0}, verify_rate=None, min_blocks=1
    )
    try:
        result = await coord.router.classify(images(), SEQ)  # opens coordinator -> 0 -> 1 -> 2 streams
        assert [h.outcome for h in result.path.hops] == ["relayed"] * 3
        await asyncio.wait_for(served[1].stop(), 10.0)  # far under its 30 s grace
        after = await coord.router.classify(images(), SEQ)
        assert [h.block for h in after.path.hops if h.block is not None] == [0, 2]  # block 1 skipped
    finally:
        await coord.stop()
        for node in (served[0], served[2]):
            await node.stop()


def _rewriting_a_later_entry(node: FaultyNode, entry: int) -> None:
    """Make `node` a lying relay: on each chain's way back it rewrites the trace entry `entry` places
    after its own (that node's forwarding time, which steers the coordinator's link map), keeping the
    digest chain intact."""
    relay = node.relayer.relay

    async def rewriting(request: pb.RelayRequest, handle: Any) -> Any:
        async for event in relay(request, handle):
            if not event.ack and len(event.trace) > entry:
                event.trace[entry].send_ms = 5000.0
            yield event

    node.relayer.relay = rewriting  # type: ignore[method-assign]


def _failed(coord: Coordinator, served: list[FaultyNode]) -> list[int]:
    return [coord.registry.nodes[f"127.0.0.1:{n.port}"].failed for n in served]


@pytest.mark.parametrize(("keys", "entry"), [(True, 1), (True, 2), (False, 1)])
async def test_a_relay_rewriting_a_later_nodes_trace_entry_is_caught_and_alone_blamed(
    tmp_path: Path, keys: bool, entry: int
) -> None:
    """Each node signs its own entry with a per-boot key its token proof vouches for, and the digest of
    the entries after it as it passed them back: a node the entries travel back through cannot rewrite
    them, and the coordinator can tell who did. The chain is discarded, only the rewriting node is
    blamed (before, the two nodes at the rewritten entry were: honest, and the liar went free when
    the entry was not its neighbour's), and the request still answers, by star from the activation the
    coordinator held. Nodes without keys (`keys=False`: from before keys existed, or leaving theirs
    out on purpose) could not be protected that way (the rewritten time got through), so they are
    never chained: every hop runs star and there is no trace to rewrite."""
    served, coord = await in_process_relay_swarm(tmp_path, [FaultSpec()] * 3, verify_rate=None, min_blocks=1)
    if not keys:  # nodes that report no key in Info, to a coordinator that meets them afresh
        await coord.stop()
        for node in served:
            node.relayer.signer.public = b""
        coord = Coordinator(coord.settings)
        await coord.start()
        await wait_until(lambda: coord.registry.reachable_depth() == 3, what="all blocks reachable")
    _rewriting_a_later_entry(served[0], entry)
    try:
        result = await coord.router.classify(images(), SEQ)
        nodes = [f"127.0.0.1:{n.port}" for n in served]
        if keys:
            (handback,) = result.path.handbacks
            assert "trace step 0" in handback["reason"], handback  # where the node that rewrote signed
            assert "the entries after it are not the ones its node passed back" in handback["reason"]
            assert _failed(coord, served) == [1, 0, 0]  # the rewriting node, and it alone
            # It is left out of this request (no other node serves block 0 here); the honest ones chain on.
            hops = [(h.block, h.outcome) for h in result.path.hops if h.block is not None]
            assert hops == [(1, "relayed"), (2, "relayed")]
            # The forged 5 s never got in: the link's estimate for what crossed it stays far below it
            # (honest: milliseconds; per megabyte it can read thousands for a few kB on a loaded machine).
            hop_bytes = result.path.activations.numel() * 4  # at most what one activation is on the wire
            forged = coord.registry.links.transfer_ms(nodes[entry - 1], nodes[entry], hop_bytes)
            assert forged is None or forged < 1000
        else:
            assert [h.outcome for h in result.path.hops] == ["ok"] * 3 and not result.path.handbacks
            assert coord.registry.links.per_mb(nodes[1], nodes[2]) is None  # no node-to-node traffic
        scraped = generate_latest(coord.metrics.registry).decode()  # what an operator's alert reads
        discarded = 'layerswarm_relay_chains_total{outcome="discarded"} 1.0' in scraped
        completed = 'layerswarm_relay_chains_total{outcome="completed"} 1.0' in scraped
        # keys: the rewritten chain discarded, the honest rest chained after it; none: no chain at all
        assert (discarded, completed) == ((True, True) if keys else (False, False))
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_node_signing_garbage_is_handed_back_by_its_predecessor_which_is_not_blamed(tmp_path: Path) -> None:
    """A node that signs its own entry with garbage: the node before it checks that entry (with the key
    the MACed chain names) before passing it back, and hands back its own output instead, naming the
    liar. Before, the coordinator found the bad entry and blamed both nodes at it: a liar took an
    honest predecessor down with it on every chain.

    A hand-back is a claim the coordinator cannot check (the claimer could have made the bad entry up),
    so the liar is only left out of each request, and it answers the coordinator's health probe: the
    claims read as contradicted. After three in a row the node before it only ends chains, so the liar
    starts the next chain, where the coordinator checks its entry itself and blames it alone."""
    served, coord = await in_process_relay_swarm(tmp_path, [FaultSpec()] * 3, verify_rate=None, min_blocks=1)
    relay = served[1].relayer.relay

    async def garbage(request: pb.RelayRequest, handle: Any) -> Any:
        async for event in relay(request, handle):
            if not event.ack:
                event.trace[0].signature = bytes(64)
            yield event

    served[1].relayer.relay = garbage  # type: ignore[method-assign]
    try:
        for _ in range(3):
            result = await coord.router.classify(images(), SEQ)
            await coord.handbacks.wait()
            (handback,) = result.path.handbacks
            assert handback["kind"] == "handed_back" and f"step 1 (127.0.0.1:{served[1].port}" in handback["reason"]
            assert "its trace entry cannot be believed: it is not signed by its node" in handback["reason"]
            assert _failed(coord, served) == [0, 0, 0]
            hops = [(h.block, h.outcome) for h in result.path.hops if h.block is not None]
            assert hops[0] == (0, "relayed") and 1 not in [b for b, _ in hops] and hops[-1][0] == 2
        assert not coord.registry.claims.may_forward(f"127.0.0.1:{served[0].port}")
        result = await coord.router.classify(images(), SEQ)
        (handback,) = result.path.handbacks
        assert handback["kind"] == "discarded" and "trace step 0" in handback["reason"], handback
        assert _failed(coord, served) == [0, 1, 0]
        assert (result.path.hops[0].block, result.path.hops[0].outcome) == (0, "ok")  # node 0 ran star
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


def _lying_in_its_acknowledgement(node: FaultyNode, compute_ms: float) -> None:
    """Make `node` claim `compute_ms` in every acknowledgement it sends. The node before it measures its
    link as the time until that acknowledgement less this compute, and signs the result as its own."""
    relay = node.relayer.relay

    async def lying(request: pb.RelayRequest, handle: Any) -> Any:
        async for event in relay(request, handle):
            if event.ack:
                event.trace[0].compute_ms = compute_ms
            yield event

    node.relayer.relay = lying  # type: ignore[method-assign]


@pytest.mark.parametrize("claimed", [float("nan"), 1e7, 1e6])
async def test_a_node_lying_in_its_acknowledgement_is_named_not_the_node_before_it(
    tmp_path: Path, claimed: float
) -> None:
    """The next node's acknowledgement claims a compute time longer than the whole wait for it (NaN,
    past the trace's bounds, or within them): the node before it hands back naming that node, rather
    than signing an impossible forwarding time of its own (which would void the chain and blame it
    and the node before it) or a link faster than light (which would steer the planner). The hand-back
    is a claim: the liar is left out of the request, not marked failed (it answers the coordinator's
    probe; test_relay_handbacks.py)."""
    served, coord = await in_process_relay_swarm(tmp_path, [FaultSpec()] * 3, verify_rate=None, min_blocks=1)
    _lying_in_its_acknowledgement(served[1], claimed)
    first, liar = (f"127.0.0.1:{n.port}" for n in served[:2])
    try:
        result = await coord.router.classify(images(), SEQ)
        (handback,) = result.path.handbacks
        assert "step 1" in handback["reason"] and "acknowledgement" in handback["reason"], handback
        await coord.handbacks.wait()
        assert coord.registry.nodes[liar].failed == 0  # named, and answering the coordinator's probe
        assert coord.registry.nodes[first].failed == 0  # the honest node before it is not blamed
        assert 1 not in [h.block for h in result.path.hops]  # the liar left out, and no one else for block 1
        assert result.path.hops[0].outcome == "relayed"  # its own hop still counts
        assert coord.registry.links.per_mb(first, liar) is None  # nothing measured against the lie
        assert all(math.isfinite(s.ewma_send_ms) for s in served[0].relayer.peers.link_stats())  # type: ignore[union-attr]
        assert not served[0].relayer.peers.link_stats()  # type: ignore[union-attr]
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


def _ending_the_chain_at_itself(node: FaultyNode) -> None:
    """Make `node` answer a chain as if it were its last step: its hop, its own (properly signed) entry,
    no hand-back, and nothing forwarded, so the last node never gets the result the coordinator collects."""

    async def truncating(request: pb.RelayRequest, handle: Any) -> Any:
        reply = await handle(request.forward)
        rid, step = request.forward.request_id, request.chain[request.index]
        own = pb.HopTrace(
            node=step.address, block=step.block, position=step.position, compute_ms=reply.compute_ms,
            input_sha256=digest(request.forward.activations.data), output_sha256=digest(reply.activations.data),
        )  # fmt: skip
        node.relayer.signer.sign(own, rid, request.plan_mac)
        yield pb.RelayEvent(request_id=rid, ack=True, trace=[own])
        yield pb.RelayEvent(request_id=rid, trace=[own])

    node.relayer.relay = truncating  # type: ignore[method-assign]


@pytest.mark.parametrize(("liar", "reason"), [(1, "step 1"), (0, "without a hand-back")])
async def test_a_node_ending_a_chain_early_is_blamed_at_once_not_the_last_node(
    tmp_path: Path, liar: int, reason: str
) -> None:
    """A node that claims the chain completed at itself (no hand-back, the rest of the trace missing) is
    caught at once: by the node before it, which hands back naming it (a claim: the liar is left out of
    the request and probed, and it answers), or, the first node, by the coordinator, which blames it.
    Before, the coordinator waited on Collect at the last node, which never got the chain, for the
    request's whole deadline, then blamed that last node, and the request failed."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 4, verify_rate=None, min_blocks=1, request_timeout_s=6.0
    )
    _ending_the_chain_at_itself(served[liar])
    addresses = [f"127.0.0.1:{n.port}" for n in served]
    try:
        started = time.monotonic()
        result = await coord.router.classify(images(), SEQ)
        assert time.monotonic() - started < 3.0  # not the request's whole deadline
        assert any(reason in h["reason"] for h in result.path.handbacks), result.path.handbacks
        assert coord.registry.nodes[addresses[liar]].failed == (1 if liar == 0 else 0)
        assert all(coord.registry.nodes[a].failed == 0 for a in addresses if a != addresses[liar])
        ran = [h.block for h in result.path.hops if h.block is not None]
        assert sorted(ran) == [b for b in range(4) if b != liar]  # only the liar's block left out
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


def test_a_next_nodes_events_are_checked_before_they_are_believed() -> None:
    """What a node checks in its next node's events (node/relay.py), before it signs anything from them
    or passes them back: an acknowledgement's compute within the wait for it, and a final event that
    holds the next step's entry and the rest, all of them unless it hands back."""
    from layerswarm.node.relay import ack_problem, final_problem

    assert ack_problem(pb.HopTrace(compute_ms=4.0), waited_ms=5.0) is None
    for compute_ms in (float("nan"), float("inf"), -1.0, 7.0):
        assert "implausible acknowledgement" in (ack_problem(pb.HopTrace(compute_ms=compute_ms), 5.0) or "")
    chain = [pb.RelayStep(address=f"n:{k}", position=k, block=k) for k in range(4)]
    entries = [pb.HopTrace(node=s.address, block=s.block, position=s.position) for s in chain]
    assert final_problem(pb.RelayEvent(trace=entries[1:]), chain, 1) is None
    assert final_problem(pb.RelayEvent(trace=entries[1:2], handback_reason="step 2: dead"), chain, 1) is None
    for bad in (
        pb.RelayEvent(trace=entries[1:3]),  # short, without a hand-back
        pb.RelayEvent(trace=[], handback_reason="x"),  # a hand-back without the next node's own entry
        pb.RelayEvent(trace=entries[1:], ack=True),  # a second acknowledgement
        pb.RelayEvent(trace=[*entries[1:], entries[3]]),  # longer than the chain
        pb.RelayEvent(trace=entries[2:], handback_reason="x"),  # not starting at the next step
    ):
        assert "malformed final event" in (final_problem(bad, chain, 1) or ""), bad


def _talking_on_after_its_final_event(node: FaultyNode, extra: int) -> None:
    """Make `node` keep its Relay calls open after a chain's final event, sending `extra` more events
    (acknowledgements and finals, 10 ms apart): what a hostile first node can send a coordinator that
    starts chains with a Relay call per chain (--transport unary, or a node answering RelayStream
    UNIMPLEMENTED, which any node may)."""
    make = node.make_service

    def make_service() -> Any:
        service = make()
        relay = service.Relay

        async def talkative(request: pb.RelayRequest, context: grpc.aio.ServicerContext) -> Any:
            async for event in relay(request, context):
                yield event
            for k in range(extra):
                yield pb.RelayEvent(request_id=request.forward.request_id, ack=k % 2 == 0, handback_reason="more")
                await asyncio.sleep(0.01)

        service.Relay = talkative  # type: ignore[method-assign]
        return service

    node.make_service = make_service  # type: ignore[method-assign]


async def test_a_relay_call_is_read_up_to_its_final_event_only(tmp_path: Path) -> None:
    """The coordinator reads a Relay call's acknowledgement and final event, then ends the call: a node
    that keeps sending after its final event gets neither the coordinator's memory (before: every event
    kept, up to the request's deadline) nor its time (before: the chain waited for the call to end)."""
    model = make_model_dir(tmp_path / "m", depth=2)
    security = SecuritySettings(token=TOKEN)
    served = [
        FaultyNode(NodeSettings(model_dir=model, block=b, advertise=False, security=security, grace_s=0.1), FaultSpec())
        for b in range(2)
    ]
    _talking_on_after_its_final_event(served[0], extra=400)
    for node in served:
        await node.start()
    first, second = (f"127.0.0.1:{n.port}" for n in served)
    client = NodeClient(first, 64 * 1024 * 1024, transport="unary", security=security)
    chain = [pb.RelayStep(address=first, position=0, block=0), pb.RelayStep(address=second, position=1, block=1)]
    forward = pb.ForwardRequest(request_id="r", activations=codec.encode(torch.zeros(1, 5, 32)), position=0)
    request = pb.RelayRequest(
        forward=forward, chain=chain, plan_mac=plan_mac(derive_key(TOKEN), "r", 1, chain, collect=False), issued_ms=1,
        hop_timeout_s=2.0, deadline_s=10.0, collect=False,
    )  # fmt: skip
    try:
        await client.info(2.0)
        started = time.monotonic()
        events = await client.relay(request, 10.0)
        assert time.monotonic() - started < 2.0  # not the 4 s the node keeps talking
        assert [e.ack for e in events] == [True, False] and not events[-1].handback_reason
        assert [t.block for t in events[-1].trace] == [0, 1]
    finally:
        await client.close()
        for node in served:
            await node.stop()


def _acknowledging_then_stalling(node: FaultyNode) -> None:
    """Make `node` compute and acknowledge its hop, then never send its final event (nor forward)."""

    async def stalling(request: pb.RelayRequest, handle: Any) -> Any:
        reply = await handle(request.forward)
        rid, step = request.forward.request_id, request.chain[request.index]
        own = pb.HopTrace(node=step.address, block=step.block, position=step.position, compute_ms=reply.compute_ms)
        yield pb.RelayEvent(request_id=rid, ack=True, trace=[own])
        await asyncio.sleep(3600)

    node.relayer.relay = stalling  # type: ignore[method-assign]


async def test_a_node_withholding_its_final_event_is_the_one_handed_back(tmp_path: Path) -> None:
    """A node that acknowledges, then stalls: the node before it stops waiting a margin before the
    deadline its caller gave, so its hand-back, naming the staller, arrives while the caller still waits.
    Before, every wait along the chain ended together: the coordinator timed out first and blamed the
    chain's first node (ejected after two requests) while the staller stayed healthy. The hand-back is
    a claim: the staller answers the coordinator's health probe, so it is not marked failed either."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 4, verify_rate=None, min_blocks=1, request_timeout_s=3.0
    )
    _acknowledging_then_stalling(served[1])
    first, staller = (f"127.0.0.1:{n.port}" for n in served[:2])
    try:
        for _ in range(2):
            result = await coord.router.classify(images(), SEQ)
            assert any("step 1" in h["reason"] and "DEADLINE_EXCEEDED" in h["reason"] for h in result.path.handbacks)
            assert result.path.hops[0].block == 0 and result.path.hops[0].outcome == "relayed"
            await coord.handbacks.wait()
        assert coord.registry.nodes[staller].failed == 0
        assert coord.registry.claims.get(first).contradicted == 2  # type: ignore[union-attr]
        assert coord.registry.nodes[first].failed == 0 and coord.registry.nodes[first].state.value == "healthy"
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_node_that_gives_no_trace_key_is_served_star_never_chained(tmp_path: Path) -> None:
    """Unsigned trace entries would let an earlier node cut the trace short and hand back in a later
    node's name, and a node chooses what its own Info says: one could leave its key out to get exactly
    that. So a node without a key never joins a chain; its step runs star and the rest still relay."""
    served, coord = await in_process_relay_swarm(tmp_path, [FaultSpec()] * 4, keyless=(1,), verify_rate=None)
    try:
        keyless = f"127.0.0.1:{served[1].port}"
        assert coord.registry.nodes[keyless].identity.trace_key == b""  # type: ignore[union-attr]
        for _ in range(2):
            result = await coord.router.classify(images(), SEQ)
            outcomes = {h.node: h.outcome for h in result.path.hops}
            assert result.path.depth == 4 and outcomes[keyless] == "ok", result.path.hops
            assert [h.outcome for h in result.path.hops][2:] == ["relayed", "relayed"]
        assert coord.registry.nodes[keyless].failed == 0
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_node_clearing_collect_for_the_last_node_cannot_get_it_failed(tmp_path: Path) -> None:
    """The coordinator collects a chain's result from its last node (Collect, opened with the chain),
    which keeps it only when the chain says `collect`. Before, that flag was outside the chain's MAC: a
    node clearing it for the rest of the chain made the last node send its result back along the chain
    instead, the coordinator's Collect waited out the request's deadline, and the last two nodes, both
    honest, were failed for it (ejected after two requests). Now the MAC covers it: the next node
    refuses the altered chain, the tampering node is the one that must hand back (its claims are
    contradicted: the named node answers), the request goes on from the hand-back (block 2's replica
    serves), and nobody honest is failed."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 5, blocks=[0, 1, 2, 2, 3], verify_rate=None, min_blocks=1, request_timeout_s=3.0
    )
    tampering_onward(served[1], lambda request: setattr(request, "collect", False))
    try:
        for _ in range(3):
            started = time.monotonic()
            result = await coord.router.classify(images(), SEQ)
            assert time.monotonic() - started < 2.0  # far under the deadline (3 s) it waited out before
            assert result.path.depth == 4, result.path.hops
            (handback,) = result.path.handbacks
            assert "PERMISSION_DENIED" in handback["reason"] and "MAC" in handback["reason"], handback
            await coord.handbacks.wait()
        assert _failed(coord, served) == [0, 0, 0, 0, 0]
        assert coord.registry.claims.get(f"127.0.0.1:{served[1].port}").contradicted == 3  # type: ignore[union-attr]
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_node_racing_the_last_step_with_its_own_input_cannot_get_the_last_node_failed(
    tmp_path: Path,
) -> None:
    """Before, the last node kept the first result for a request id and Collect returned it: a node of
    the chain running the last step first with an input of its own made the coordinator collect that
    result, whose digest is not the one the last node signed for the honest chain, and the honest last
    node was failed for it (ejected after two requests). Now the last node keeps each result it made
    for the request and the coordinator, on a digest that differs, collects again by the digest the
    last node signed: the honest answer, nobody failed."""
    served, coord = await in_process_relay_swarm(tmp_path, [FaultSpec()] * 4, verify_rate=None, min_blocks=1)
    try:
        reference = await coord.router.classify(images(), SEQ)
        assert [h.outcome for h in reference.path.hops] == ["relayed"] * 4
        running_the_last_step_first(served[1], times=1)
        for _ in range(3):
            result = await coord.router.classify(images(), SEQ)
            assert [h.outcome for h in result.path.hops] == ["relayed"] * 4, result.path
            assert torch.allclose(result.probs, reference.probs, atol=1e-6)
        assert _failed(coord, served) == [0, 0, 0, 0]
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


@pytest.mark.parametrize("wrong", ["block", "trace_key"])
async def test_a_node_pointed_at_another_nodes_step_refuses_it_before_computing(tmp_path: Path, wrong: str) -> None:
    """The plan MAC does not cover `index`: a caller holding the token could point a node at another
    node's step (that step's position, its onward link). A node refuses a step that names another block
    or another trace key than its own, with INVALID_ARGUMENT, and computes nothing; its own step runs."""
    model = make_model_dir(tmp_path / "m", depth=2)
    security = SecuritySettings(token=TOKEN)
    node = FaultyNode(
        NodeSettings(model_dir=model, block=0, advertise=False, security=security, grace_s=0.1), FaultSpec()
    )
    await node.start()
    address = f"127.0.0.1:{node.port}"
    client = NodeClient(address, 64 * 1024 * 1024, transport="unary", security=security)
    own_key = node.relayer.signer.public

    def request(block: int, trace_key: bytes) -> pb.RelayRequest:
        chain = [pb.RelayStep(address=address, position=1, block=block, trace_key=trace_key)]
        forward = pb.ForwardRequest(request_id="r", activations=codec.encode(torch.zeros(1, 5, 32)), position=1)
        mac = plan_mac(derive_key(TOKEN), "r", 1, chain, collect=False)
        return pb.RelayRequest(
            forward=forward, chain=chain, plan_mac=mac, issued_ms=1, hop_timeout_s=2.0, deadline_s=10.0
        )

    try:
        await client.info(2.0)
        wrong_step = request(1, own_key) if wrong == "block" else request(0, bytes(32))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.relay(wrong_step, 10.0)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "relay step 0 refused" in (refused.value.details() or "")
        assert node.runtime.served == 0
        events = await client.relay(request(0, own_key), 10.0)  # its own step, named rightly
        assert not events[-1].handback_reason and events[-1].HasField("activations")
        assert node.runtime.served == 1
    finally:
        await client.close()
        await node.stop()
