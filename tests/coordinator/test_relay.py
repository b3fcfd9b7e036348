"""Relay chains through real node processes: the same logits as star, a dead node handed back around,
and a node that refuses to forward along a chain the coordinator did not MAC."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, CoordinatorSettings, NodeClient, Policy, create_app
from layerswarm.coordinator.membership.linkmap import LinkMap
from layerswarm.coordinator.membership.records import NodeRecord
from layerswarm.coordinator.relay.chain_trace import observe_relay_link
from layerswarm.coordinator.routing.executor import Resume
from layerswarm.coordinator.routing.planner import Plan, Step
from layerswarm.coordinator.routing.request import Request
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.harness.procs import Proc, stop_all
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.auth import CHALLENGE_KEY, derive_key, metadata_value
from layerswarm.wire.relay_plan import plan_mac
from layerswarm.wire.relay_stream import RelayLink
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb

from ..conftest import make_model_dir
from ..relay_lab import DEPTH, SEQ, TOKEN, images, in_process_relay_swarm
from ..swarm import address, coordinator, start_nodes, wait_until


@pytest.fixture(scope="module")
def relay_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, list[Proc]]]:
    """Four node processes (one block each) sharing a swarm token."""
    root = tmp_path_factory.mktemp("relay")
    model_dir = make_model_dir(root / "model", depth=DEPTH)
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    procs = start_nodes([(model_dir, b) for b in range(DEPTH)], "--token-file", str(token_file))
    try:
        yield model_dir, token_file, procs
    finally:
        stop_all(procs)


async def classify(model_dir: Path, token_file: Path, procs: list[Proc], topology: str) -> tuple[torch.Tensor, list]:
    coord = coordinator(model_dir, procs, topology=topology, token_file=token_file, verify_rate=None)
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == DEPTH, what="all blocks reachable")
        result = await coord.router.classify(images(), SEQ)
        if topology == "relay":  # every node -> node link of the chain was measured from its traffic
            for a, b in itertools.pairwise(procs):
                assert address(b) in coord.registry.links.from_node(address(a))
        return result.probs, result.path.hops
    finally:
        await coord.stop()


async def test_a_relay_chain_gives_the_same_logits_as_star(relay_swarm: tuple[Path, Path, list[Proc]]) -> None:
    model_dir, token_file, procs = relay_swarm
    star_probs, star_hops = await classify(model_dir, token_file, procs, "star")
    relay_probs, relay_hops = await classify(model_dir, token_file, procs, "relay")
    assert [h.outcome for h in relay_hops] == ["relayed"] * DEPTH
    assert [h.block for h in relay_hops] == [h.block for h in star_hops] == list(range(DEPTH))
    assert torch.equal(relay_probs, star_probs)  # fp32 on the wire: bit for bit


async def test_a_node_refuses_a_chain_the_coordinator_did_not_mac(relay_swarm: tuple[Path, Path, list[Proc]]) -> None:
    _, _, procs = relay_swarm
    first, second = address(procs[0]), address(procs[1])
    client = NodeClient(first, 64 * 1024 * 1024, security=SecuritySettings(token=TOKEN))
    x = torch.zeros(1, 5, 32)
    forward = pb.ForwardRequest(request_id="r1", activations=codec.encode(x, torch.float32), position=0)
    honest = [pb.RelayStep(address=first, position=0, block=0), pb.RelayStep(address=second, position=1, block=1)]
    rogue = [honest[0], pb.RelayStep(address="10.9.9.9:22", position=1, block=1)]

    def request(chain: list[pb.RelayStep], key: bytes) -> pb.RelayRequest:
        mac = plan_mac(key, "r1", 1, honest, collect=True)  # made for the honest chain
        return pb.RelayRequest(
            forward=forward, chain=chain, plan_mac=mac, issued_ms=1, hop_timeout_s=1.0, deadline_s=2.0, collect=True
        )

    try:
        await client.info(2.0)
        for bad in (request(rogue, derive_key(TOKEN)), request(honest, derive_key("another swarm"))):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.relay(bad, 5.0)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "relay chain refused" in (caught.value.details() or "")
        unbounded = request(honest, derive_key(TOKEN))
        unbounded.hop_timeout_s = float("inf")  # a node never waits on a caller's unbounded say
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.relay(unbounded, 5.0)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        events = await client.relay(request(honest, derive_key(TOKEN)), 5.0)  # the same chain, MACed: runs
        assert events[0].ack and not events[-1].handback_reason
        assert [t.block for t in events[-1].trace] == [0, 1]
        info = await client.info(2.0)  # the node reports the link it forwarded over, measured
        assert any(link.peer == second and link.samples >= 1 for link in info.links)
    finally:
        await client.close()


async def test_a_chain_naming_a_port_of_non_ascii_digits_is_refused_not_a_crash(
    relay_swarm: tuple[Path, Path, list[Proc]],
) -> None:
    """ "²" is a digit to str.isdigit but not to int(): a chain (MACed, so from a token holder) naming the
    port "²" raised ValueError in the node's address check, answered UNKNOWN to a Relay call and INTERNAL
    (with a traceback in the node's log) on a RelayStream. It is a malformed chain like any other."""
    _, _, procs = relay_swarm
    first = address(procs[0])
    client = NodeClient(first, 64 * 1024 * 1024, security=SecuritySettings(token=TOKEN))
    chain = [pb.RelayStep(address=first, position=0, block=0), pb.RelayStep(address="127.0.0.1:²", position=1, block=1)]

    def request(rid: str) -> pb.RelayRequest:
        forward = pb.ForwardRequest(request_id=rid, activations=codec.encode(torch.zeros(1, 5, 32), torch.float32))
        return pb.RelayRequest(
            forward=forward, chain=chain, issued_ms=1, hop_timeout_s=2.0, deadline_s=5.0,
            plan_mac=plan_mac(derive_key(TOKEN), rid, 1, chain, collect=False),
        )  # fmt: skip

    try:
        await client.info(2.0)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _drain(client.block.Relay(request("call"), metadata=client._signed("Relay")))
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED, caught.value
        assert "malformed step address" in (caught.value.details() or "")
        stream = client.block.RelayStream(metadata=client._signed("RelayStream"))
        await stream.write(request("stream"))
        refused = await stream.read()
        assert refused.refused == "PERMISSION_DENIED" and "malformed step address" in refused.handback_reason
        stream.cancel()
    finally:
        await client.close()


async def _drain(call: Any) -> list[Any]:
    return [event async for event in call]


async def test_a_relay_stream_needs_a_signature_and_survives_a_refused_chain(
    relay_swarm: tuple[Path, Path, list[Proc]],
) -> None:
    """RelayStream through a real node: unsigned, it is refused as a whole; signed, a chain the
    coordinator did not MAC is refused as an event and the same stream then carries a MACed one."""
    _, _, procs = relay_swarm
    first, second = address(procs[0]), address(procs[1])
    client = NodeClient(first, 64 * 1024 * 1024, security=SecuritySettings(token=TOKEN))
    chain = [pb.RelayStep(address=first, position=0, block=0), pb.RelayStep(address=second, position=1, block=1)]

    def request(rid: str, key: bytes) -> pb.RelayRequest:
        forward = pb.ForwardRequest(request_id=rid, activations=codec.encode(torch.zeros(1, 5, 32), torch.float32))
        return pb.RelayRequest(
            forward=forward, chain=chain, plan_mac=plan_mac(key, rid, 1, chain, collect=False), issued_ms=1,
            hop_timeout_s=2.0, deadline_s=5.0, collect=False,
        )  # fmt: skip

    try:
        unsigned = RelayLink(first, client.block.RelayStream)  # a stream opened without a signature
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await (await unsigned.send(request("u", derive_key(TOKEN)))).read()
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED  # (whether its write got out or not)
        assert metadata_value(caught.value.trailing_metadata(), CHALLENGE_KEY)  # the node's challenge, to sign
        await client.info(2.0)
        stream = client.block.RelayStream(metadata=client._signed("RelayStream"))
        await stream.write(request("forged", derive_key("another swarm")))
        refused = await stream.read()
        assert refused.refused == "PERMISSION_DENIED" and "relay chain refused" in refused.handback_reason
        await stream.write(request("honest", derive_key(TOKEN)))
        ack, final = await stream.read(), await stream.read()
        assert ack.ack and ack.request_id == "honest"
        assert [t.block for t in final.trace] == [0, 1] and not final.handback_reason
        assert final.HasField("activations")  # collect=False: the result comes back along the chain
        stream.cancel()
    finally:
        await client.close()


async def test_a_chain_over_slow_links_is_sent_in_int8_with_wire_auto(
    relay_swarm: tuple[Path, Path, list[Proc]],
) -> None:
    model_dir, token_file, procs = relay_swarm
    coord = coordinator(model_dir, procs, topology="relay", token_file=token_file, verify_rate=None, wire_dtype="auto")
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == DEPTH, what="all blocks reachable")
        first = await coord.router.classify(images(), SEQ)
        assert {h.wire for h in first.path.hops} == {"fp16"}  # loopback-fast links: fp16
        ends = ["coordinator", *(address(p) for p in procs), "coordinator"]
        for a, b in itertools.pairwise(ends):  # as a very slow LAN would measure (160 kbit/s)
            for _ in range(20):
                coord.registry.links.observe(a, b, 1_000, 50.0)
        slow = await coord.router.classify(images(), SEQ)
        assert slow.path.topology == "relay" and {h.wire for h in slow.path.hops} == {"int8"}
        assert torch.allclose(slow.probs, first.probs, atol=2e-2)
    finally:
        await coord.stop()


async def test_node_to_node_links_are_probed_so_their_latency_is_not_counted_as_bytes(
    relay_swarm: tuple[Path, Path, list[Proc]],
) -> None:
    """The sending node probes each link's round trip and reports it in the trace: the coordinator's
    map then holds node -> node RTTs and takes them off the per-byte cost (the wire choice reads it)."""
    model_dir, token_file, procs = relay_swarm
    coord = coordinator(model_dir, procs, topology="relay", token_file=token_file, verify_rate=None)
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == DEPTH, what="all blocks reachable")
        for _ in range(2):
            result = await coord.router.classify(images(), SEQ)
        assert result.path.topology == "relay"
        for a, b in itertools.pairwise(procs):
            link = coord.registry.links.from_node(address(a))[address(b)]
            assert link["rtt_ms"] is not None and 0 < link["rtt_ms"] < 1_000
        client = NodeClient(address(procs[0]), 64 * 1024 * 1024, security=SecuritySettings(token=TOKEN))
        try:
            info = await client.info(2.0)
        finally:
            await client.close()
        stat = next(link for link in info.links if link.peer == address(procs[1]))
        assert stat.rtt_ms > 0 and stat.samples >= 2
    finally:
        await coord.stop()


def test_a_relay_link_s_per_byte_cost_leaves_out_both_ways_of_the_rtt() -> None:
    """send_ms = the way there (half the RTT + bytes) + the acknowledgement's way back (half the RTT)."""
    links = LinkMap()
    observe_relay_link(
        links, pb.HopTrace(node="a:1", send_ms=14.0, rtt_ms=4.0, sent_bytes=1_000_000), pb.HopTrace(node="b:2")
    )
    assert links.per_mb("a:1", "b:2") == pytest.approx(10.0)
    assert links.transfer_ms("a:1", "b:2", 1_000_000) == pytest.approx(12.0)


async def test_auto_is_the_default_topology_and_relays_only_where_a_chain_keeps_the_request(
    relay_swarm: tuple[Path, Path, list[Proc]],
) -> None:
    """With a swarm token and no --topology, routes run star or relay, whichever has measured faster
    (both tried first), each route's trace and the page say which; a request that needs a per-hop
    exit or an anytime deadline stays on star, since a chain would drop them."""
    from dataclasses import replace

    from layerswarm.coordinator.http.activity import Activity
    from layerswarm.coordinator.http.page import swarm_snapshot
    from layerswarm.coordinator.routing.topology import MIN_SAMPLES

    model_dir, token_file, procs = relay_swarm
    assert CoordinatorSettings.model_fields["topology"].default == "auto"
    coord = coordinator(model_dir, procs, token_file=token_file, verify_rate=None)
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == DEPTH, what="all blocks reachable")
        ran = [(await coord.router.classify(images(), SEQ)).path.topology for _ in range(2 * MIN_SAMPLES)]
        assert sorted(ran) == ["relay"] * MIN_SAMPLES + ["star"] * MIN_SAMPLES
        for options in (replace(SEQ, exit_rule="confidence", exit_threshold=0.99), replace(SEQ, deadline_ms=5_000)):
            for _ in range(4):
                assert (await coord.router.classify(images(), options)).path.topology == "star"
        view = swarm_snapshot(coord, Activity())["topology"]
        assert view["setting"] == "auto" and view["relay_available"]
        assert view["measured"] is not None and view["measured"]["relay"]["samples"] == MIN_SAMPLES
    finally:
        await coord.stop()


async def test_auto_without_a_swarm_token_stays_on_star_and_says_why(
    relay_swarm: tuple[Path, Path, list[Proc]],
) -> None:
    from layerswarm.coordinator.http.activity import Activity
    from layerswarm.coordinator.http.page import swarm_snapshot

    model_dir, _, procs = relay_swarm
    coord = coordinator(model_dir, procs, verify_rate=None)  # the nodes want a token: only readiness matters
    await coord.start()
    try:
        view = swarm_snapshot(coord, Activity())["topology"]
        assert view["setting"] == "auto" and not view["relay_available"] and "no swarm token" in view["why"]
        assert coord.router.topology is None  # nothing measured: relay cannot run here
    finally:
        await coord.stop()


async def test_a_node_killed_mid_chain_is_handed_back_and_the_request_answers(
    relay_swarm: tuple[Path, Path, list[Proc]],
) -> None:
    """Runs last in this module: it kills block 1's node. The coordinator still believes the node is
    up (slow health checks), so the chain is planned through it; block 0's node hands back."""
    model_dir, token_file, procs = relay_swarm
    coord = coordinator(
        model_dir, procs, topology="relay", token_file=token_file, verify_rate=None, health_interval_s=60, min_blocks=1
    )
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == DEPTH, what="all blocks reachable")
        procs[1].stop(timeout=5)
        transport = httpx.ASGITransport(app=create_app(coord))
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as client:
            from layerswarm.harness.samples import png_bytes

            files = {"file": ("x.png", png_bytes(torch.rand(3, 16, 16).numpy()), "image/png")}
            data = {"policy": "sequential", "exit_rule": "none"}
            reply = await client.post("/v1/classify", files=files, data=data)
            listed = (await client.get("/v1/nodes")).json()["nodes"]
        assert reply.status_code == 200, reply.text
        trace = reply.json()["trace"]
        assert trace["topology"] == "relay"
        assert trace["handbacks"] and "step 1" in trace["handbacks"][0]["reason"]
        ran = [h["block"] for h in trace["hops"] if h["block"] is not None]
        assert 1 not in ran and {0, 2, 3} <= set(ran)
        links = {n["address"]: n["links"] for n in listed}  # measured from this request's traffic
        assert address(procs[3]) in links[address(procs[2])]  # the chain after the hand-back
    finally:
        await coord.stop()


def test_relay_topology_needs_a_swarm_token(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="--token-file"):
        CoordinatorSettings(model_dir=make_model_dir(tmp_path / "m"), topology="relay", mdns=False)


async def test_a_node_without_a_token_refuses_to_relay(tmp_path: Path) -> None:
    from layerswarm.node.server import Node

    node = Node(NodeSettings(model_dir=make_model_dir(tmp_path / "m"), block=0, advertise=False, grace_s=0.1))
    await node.start()
    client = NodeClient(f"127.0.0.1:{node.port}", 64 * 1024 * 1024)
    try:
        forward = pb.ForwardRequest(request_id="r", activations=codec.encode(torch.zeros(1, 5, 32)), position=0)
        step = pb.RelayStep(address=f"127.0.0.1:{node.port}", position=0, block=0)
        request = pb.RelayRequest(forward=forward, chain=[step], hop_timeout_s=1.0, deadline_s=1.0, plan_mac="x")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.relay(request, 5.0)
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "swarm token" in (caught.value.details() or "")
    finally:
        await client.close()
        await node.stop()


async def test_a_node_slower_than_the_hop_timeout_is_handed_back(tmp_path: Path) -> None:
    """The slow node is left out of the request. A timeout cannot be proved, so the hand-back alone does
    not mark it failed: the coordinator forwards the handed-back activation to it itself, within the
    hop timeout; it is too slow for the coordinator too, so its failure is recorded (the coordinator's
    own observation) and the claim reads as confirmed."""
    faults = [FaultSpec(), FaultSpec(delay_ms=1500), FaultSpec()]
    served, coord = await in_process_relay_swarm(tmp_path, faults, hop_timeout_s=0.5, verify_rate=None, min_blocks=1)
    try:
        result = await coord.router.classify(images(), SEQ)
        assert result.path.handbacks and "DEADLINE_EXCEEDED" in result.path.handbacks[0]["reason"]
        assert [h.block for h in result.path.hops if h.block is not None] == [0, 2]  # block 1 skipped
        await coord.handbacks.wait()
        assert coord.registry.nodes[f"127.0.0.1:{served[1].port}"].failed == 1
        assert coord.registry.claims.get(f"127.0.0.1:{served[0].port}").confirmed == 1  # type: ignore[union-attr]
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_handed_back_step_takes_a_spare_block_never_one_the_route_runs_later(tmp_path: Path) -> None:
    """Shuffled routes of 3 of 4 blocks; block 1's node stalls past the hop timeout (kept routable) and
    is handed back. Its step then runs star with a spare block, which must be the one block the route
    leaves out: a block the route runs later would be skipped at its own step, and the answer would
    lose a block for the one it saved. Before the fix a relay's star step saw no later steps, so it
    drew among both (half the time, or two thirds, the wrong one)."""
    faults = [FaultSpec(), FaultSpec(delay_ms=1500), FaultSpec(), FaultSpec()]
    served, coord = await in_process_relay_swarm(
        tmp_path, faults, hop_timeout_s=0.4, eject_after=1000, verify_rate=None, min_blocks=1
    )
    try:
        substituted = 0
        for seed in range(12):
            options = ClassifyOptions(policy=Policy.SHUFFLE, seed=seed, max_blocks=3, exit_rule="none")
            path = (await coord.router.classify(images(), options)).path
            planned = [h.planned_block for h in path.hops]
            if 1 not in planned or planned.index(1) == len(planned) - 1:
                continue  # block 1 last or not planned: no later block to protect
            spare = ({0, 1, 2, 3} - set(planned)).pop()
            ran = [h.block for h in path.hops if h.block is not None]
            assert sorted(ran) == sorted({*planned, spare} - {1}), (seed, planned, ran, path.handbacks)
            substituted += 1
        assert substituted >= 4  # enough draws that the old code's coin would have shown
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_resumed_step_never_asks_a_node_the_route_left_out(tmp_path: Path) -> None:
    """A relay route runs its failed steps star one at a time (executor.Resume). A node the route left
    out (it failed earlier in the request, or a hand-back named it) is not asked again, as a spare either:
    block 0 has no node here, so its step takes a spare block, which must be block 2, never the left-out
    node of block 1. Before, the resumed step knew only its own failures and drew either."""
    served, coord = await in_process_relay_swarm(tmp_path, [FaultSpec()] * 3, verify_rate=None, min_blocks=1)
    try:
        left_out = f"127.0.0.1:{served[1].port}"
        with torch.inference_mode():
            x = coord.router.stem(images())
        for seed in range(8):
            request = Request(
                options=ClassifyOptions(),
                id=f"resumed-{seed}",
                inputs=images(),
                x=x,
                policy=Policy.SHUFFLE,
                seed=seed,
                min_blocks=0,
                anytime_min_blocks=0,
                shuffle_robust=True,
                deadline=time.monotonic() + 10.0,
                anytime_deadline=None,
            )
            resume = Resume(position=0, used=frozenset(), path_length=1, avoid=frozenset({left_out}))
            plan = Plan([Step(0, [])], [])
            path = await coord.router.executor.run(x, plan, request, request.id, random.Random(seed), resume=resume)
            (hop,) = path.hops
            assert (hop.block, hop.outcome) == (2, "ok"), (seed, hop)
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


@pytest.mark.parametrize("old_first_node", [False, True])
async def test_a_first_node_slower_than_the_hop_timeout_costs_a_hop_not_the_deadline(
    tmp_path: Path, old_first_node: bool
) -> None:
    """The coordinator holds a chain's first node to the rule every node holds the next one to: its
    acknowledgement (sent once its block has run) within the hop timeout. Before, it waited for the
    whole request deadline, so a first node that stalled cost every request through it that deadline.
    What the coordinator saw itself is evidence: the first node's failure is recorded. Both ways of
    starting a chain: the long-lived stream, and a Relay call (a node without RelayStream)."""
    faults = [FaultSpec(delay_ms=3000), FaultSpec(), FaultSpec()]
    served, coord = await in_process_relay_swarm(
        tmp_path,
        faults,
        old_nodes=(0,) if old_first_node else (),
        hop_timeout_s=0.5,
        request_timeout_s=30.0,
        verify_rate=None,
        min_blocks=1,
    )
    try:
        result = await coord.router.classify(images(), SEQ)
        (started,) = [h for h in result.path.handbacks if h["kind"] == "not_started"]
        assert "no acknowledgement within the hop timeout" in started["reason"], started
        assert coord.registry.nodes[f"127.0.0.1:{served[0].port}"].failed == 1
        assert [h.block for h in result.path.hops if h.block is not None] == [1, 2]  # block 0 skipped
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


@pytest.mark.parametrize("streams", [True, False])
async def test_chains_between_two_nodes_share_one_long_lived_stream(tmp_path: Path, streams: bool) -> None:
    """Node to node, every chain goes over one RelayStream (opened once); `--no-relay-streams` makes a
    Relay call per chain instead. The answers are the same either way."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 3, node_values={"relay_streams": streams}, verify_rate=None, min_blocks=1
    )
    try:
        for _ in range(4):
            result = await coord.router.classify(images(), SEQ)
            assert [h.outcome for h in result.path.hops] == ["relayed"] * 3

        def received(node: FaultyNode) -> dict[str, float]:
            samples = node.metrics.registry.get_sample_value
            return {
                rpc: samples("layerswarm_node_requests_total", {"rpc": rpc}) or 0 for rpc in ("Relay", "RelayStream")
            }

        assert received(served[0]) == {"Relay": 0, "RelayStream": 4}  # from the coordinator, on its stream
        assert received(served[1]) == ({"Relay": 0, "RelayStream": 4} if streams else {"Relay": 4, "RelayStream": 0})
        assert served[0].relayer.peers is not None
        (peer,) = served[0].relayer.peers._peers.values()
        assert peer.link.opened == (1 if streams else 0)
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_chains_reach_nodeswithout_relay_stream_by_a_call_per_chain(tmp_path: Path) -> None:
    """Nodes 0 and 1 answer RelayStream UNIMPLEMENTED (older nodes): the coordinator and node 0 send
    them a Relay call per chain instead, from the first chain on; node 1 still streams to node 2."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 3, old_nodes=(0, 1), verify_rate=None, min_blocks=1
    )
    try:
        for _ in range(3):
            result = await coord.router.classify(images(), SEQ)
            assert [h.outcome for h in result.path.hops] == ["relayed"] * 3 and not result.path.handbacks
        requests = [
            {rpc: n.metrics.registry.get_sample_value("layerswarm_node_requests_total", {"rpc": rpc}) or 0
             for rpc in ("Relay", "RelayStream")}
            for n in served
        ]  # fmt: skip
        assert requests == [
            {"Relay": 3, "RelayStream": 0},
            {"Relay": 3, "RelayStream": 0},
            {"Relay": 0, "RelayStream": 3},
        ]
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_verification_still_sees_new_nodes_in_relay_mode(tmp_path: Path) -> None:
    """Nodes on probation run star (re-executed), so a lying node is convicted before any chain goes
    through it; once the honest nodes pass probation, their hops are relayed."""
    faults = [FaultSpec(), FaultSpec(mode="noise"), FaultSpec()]
    served, coord = await in_process_relay_swarm(tmp_path, faults, verify_rate=0.0, verify_probation=2, min_blocks=1)
    liar = f"127.0.0.1:{served[1].port}"
    try:
        outcomes = []
        for _ in range(4):
            result = await coord.router.classify(images(), SEQ)
            outcomes.append([h.outcome for h in result.path.hops])
            assert liar not in {h.node for h in result.path.hops if h.block is not None}
        assert coord.registry.nodes[liar].state.value == "quarantined"
        assert "relayed" not in outcomes[0]  # everyone on probation: star, re-executed
        assert outcomes[-1] == ["relayed", "relayed"]  # blocks 0 and 2, chained
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_hop_sampled_for_verification_runs_star_even_where_it_ends_a_chain(tmp_path: Path) -> None:
    """The verifier samples each hop once: the sampled hop ends the chain before it, and must then run
    star and be re-executed, not be relayed on a second draw (which at 5% almost never hits)."""
    served, coord = await in_process_relay_swarm(tmp_path, [FaultSpec()] * 4, verify_rate=0.0, verify_probation=0)
    assert coord.verifier is not None
    asked: set[str] = set()

    def sampled_once(record: NodeRecord) -> bool:  # a draw that hits block 2's node, once per request
        hit = record.block == 2 and record.address not in asked
        asked.add(record.address)
        return hit

    coord.verifier.wants = sampled_once  # type: ignore[method-assign]
    try:
        for _ in range(2):
            asked.clear()
            result = await coord.router.classify(images(), SEQ)
            assert [h.outcome for h in result.path.hops] == ["relayed", "relayed", "ok", "ok"]
        assert coord.verifier.counters.reexecuted == 2  # block 2, forced, in each request
    finally:
        await coord.stop()
        for node in served:
            await node.stop()
