"""Relay chains through real node processes: the same logits as star, a dead node handed back around,
and a node that refuses to forward along a chain the coordinator did not MAC."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from prometheus_client import generate_latest

from layerswarm.coordinator.clients import NodeClient
from layerswarm.coordinator.core import ClassifyOptions, Coordinator
from layerswarm.coordinator.http_api import create_app
from layerswarm.coordinator.linkmap import LinkMap
from layerswarm.coordinator.planner import Policy
from layerswarm.coordinator.registry import NodeRecord
from layerswarm.coordinator.relay import observe_relay_link
from layerswarm.coordinator.settings import CoordinatorSettings
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.harness.procs import Proc, stop_all
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.auth import CHALLENGE_KEY, derive_key, metadata_value
from layerswarm.wire.relay_plan import digest, plan_mac
from layerswarm.wire.relay_stream import RelayLink
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb

from .conftest import make_model_dir
from .swarm import address, coordinator, start_nodes, wait_until

TOKEN = "relay-test-token"
DEPTH = 4
SEQ = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0, exit_rule="none")


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


def images() -> torch.Tensor:
    return torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))


async def classify(model_dir: Path, token_file: Path, procs: list[Proc], topology: str) -> tuple[torch.Tensor, list]:
    coord = coordinator(model_dir, procs, topology=topology, token_file=token_file, verify_rate=None)
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == DEPTH, what="all blocks reachable")
        result = await coord.classify(images(), SEQ)
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
        mac = plan_mac(key, "r1", 1, honest)  # made for the honest chain
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
            forward=forward, chain=chain, plan_mac=plan_mac(key, rid, 1, chain), issued_ms=1,
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
        first = await coord.classify(images(), SEQ)
        assert {h.wire for h in first.path.hops} == {"fp16"}  # loopback-fast links: fp16
        ends = ["coordinator", *(address(p) for p in procs), "coordinator"]
        for a, b in itertools.pairwise(ends):  # as a very slow LAN would measure (160 kbit/s)
            for _ in range(20):
                coord.registry.links.observe(a, b, 1_000, 50.0)
        slow = await coord.classify(images(), SEQ)
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
            result = await coord.classify(images(), SEQ)
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

    from layerswarm.coordinator.settings import CoordinatorSettings

    with pytest.raises(ValidationError, match="--token-file"):
        CoordinatorSettings(model_dir=make_model_dir(tmp_path / "m"), topology="relay", mdns=False)


async def test_a_node_without_a_token_refuses_to_relay(tmp_path: Path) -> None:
    from layerswarm.node.server import Node
    from layerswarm.node.settings import NodeSettings

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


def _without_relay_stream(node: FaultyNode) -> None:
    """Make `node` answer RelayStream as a node from before it did (UNIMPLEMENTED)."""
    make = node.make_service

    def make_service() -> Any:
        service = make()

        async def relay_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
            yield  # pragma: no cover - abort raises

        service.RelayStream = relay_stream  # type: ignore[method-assign]
        return service

    node.make_service = make_service  # type: ignore[method-assign]


async def _in_process_swarm(
    tmp_path: Path,
    faults: list[FaultSpec],
    node_values: dict[str, Any] | None = None,
    old_nodes: tuple[int, ...] = (),
    **settings: object,
) -> tuple[list[FaultyNode], Coordinator]:
    model = make_model_dir(tmp_path / "m", depth=len(faults))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    security = SecuritySettings(token=TOKEN)
    served = [
        FaultyNode(
            NodeSettings(
                model_dir=model, block=b, advertise=False, security=security, **{"grace_s": 0.1, **(node_values or {})}
            ),
            spec,
        )
        for b, spec in enumerate(faults)
    ]
    for b in old_nodes:
        _without_relay_stream(served[b])
    for node in served:
        await node.start()
    values: dict[str, object] = {"health_interval_s": 60, "hedge_quantile": None, "wire_dtype": "fp32", **settings}
    peers = tuple(f"127.0.0.1:{n.port}" for n in served)
    coord = Coordinator(
        CoordinatorSettings(model_dir=model, peers=peers, mdns=False, topology="relay", token_file=token_file, **values)  # type: ignore[arg-type]
    )
    await coord.start()
    await wait_until(lambda: coord.registry.reachable_depth() == len(faults), what="all blocks reachable")
    return served, coord


async def test_a_node_slower_than_the_hop_timeout_is_handed_back(tmp_path: Path) -> None:
    faults = [FaultSpec(), FaultSpec(delay_ms=1500), FaultSpec()]
    served, coord = await _in_process_swarm(tmp_path, faults, hop_timeout_s=0.5, verify_rate=None, min_blocks=1)
    try:
        result = await coord.classify(images(), SEQ)
        assert result.path.handbacks and "DEADLINE_EXCEEDED" in result.path.handbacks[0]["reason"]
        assert [h.block for h in result.path.hops if h.block is not None] == [0, 2]  # block 1 skipped
        assert coord.registry.nodes[f"127.0.0.1:{served[1].port}"].failed >= 1
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


@pytest.mark.parametrize("streams", [True, False])
async def test_chains_between_two_nodes_share_one_long_lived_stream(tmp_path: Path, streams: bool) -> None:
    """Node to node, every chain goes over one RelayStream (opened once); `--no-relay-streams` makes a
    Relay call per chain instead. The answers are the same either way."""
    served, coord = await _in_process_swarm(
        tmp_path, [FaultSpec()] * 3, node_values={"relay_streams": streams}, verify_rate=None, min_blocks=1
    )
    try:
        for _ in range(4):
            result = await coord.classify(images(), SEQ)
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


async def test_chains_reach_nodes_without_relay_stream_by_a_call_per_chain(tmp_path: Path) -> None:
    """Nodes 0 and 1 answer RelayStream UNIMPLEMENTED (older nodes): the coordinator and node 0 send
    them a Relay call per chain instead, from the first chain on; node 1 still streams to node 2."""
    served, coord = await _in_process_swarm(
        tmp_path, [FaultSpec()] * 3, old_nodes=(0, 1), verify_rate=None, min_blocks=1
    )
    try:
        for _ in range(3):
            result = await coord.classify(images(), SEQ)
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
    served, coord = await _in_process_swarm(tmp_path, faults, verify_rate=0.0, verify_probation=2, min_blocks=1)
    liar = f"127.0.0.1:{served[1].port}"
    try:
        outcomes = []
        for _ in range(4):
            result = await coord.classify(images(), SEQ)
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
    served, coord = await _in_process_swarm(tmp_path, [FaultSpec()] * 4, verify_rate=0.0, verify_probation=0)
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
            result = await coord.classify(images(), SEQ)
            assert [h.outcome for h in result.path.hops] == ["relayed", "relayed", "ok", "ok"]
        assert coord.verifier.counters.reexecuted == 2  # block 2, forced, in each request
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


@pytest.fixture(scope="module")
def tls_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, dict[str, Any], list[Proc]]]:
    """Three node processes with mutual TLS, the token and relay certificates (deploy/make-certs.sh)."""
    import subprocess

    root = tmp_path_factory.mktemp("relay-tls")
    certs = root / "certs"
    make = [str(Path(__file__).resolve().parents[1] / "deploy" / "make-certs.sh"), str(certs)]
    subprocess.run(["bash", *make], check=True, capture_output=True)
    model_dir = make_model_dir(root / "m", depth=3)
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    node_tls = [
        "--token-file",
        str(token_file),
        "--tls-cert",
        str(certs / "node.pem"),
        "--tls-key",
        str(certs / "node.key"),
    ]
    node_tls += ["--tls-ca", str(certs / "ca.pem")]
    relay = ["--tls-relay-cert", str(certs / "relay.pem"), "--tls-relay-key", str(certs / "relay.key")]
    procs = start_nodes([(model_dir, 0), (model_dir, 1), (model_dir, 2)], *node_tls, *relay)
    coord = {
        "token_file": token_file,
        "tls_cert": certs / "coordinator.pem",
        "tls_key": certs / "coordinator.key",
        "tls_ca": certs / "ca.pem",
        "verify_rate": None,
        "node_args": node_tls,
    }
    try:
        yield model_dir, certs, coord, procs
    finally:
        stop_all(procs)


async def _classify_with(model_dir: Path, procs: list[Proc], topology: str, coord_args: dict[str, Any]) -> Any:
    settings = {k: v for k, v in coord_args.items() if k != "node_args"}
    coord = coordinator(model_dir, procs, topology=topology, **settings)
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == 3, what="all blocks reachable")
        return await coord.classify(images(), SEQ)
    finally:
        await coord.stop()


async def test_relay_chains_under_mutual_tls_give_the_star_answer(
    tls_swarm: tuple[Path, Path, dict[str, Any], list[Proc]],
) -> None:
    model_dir, _, coord_args, procs = tls_swarm
    star = await _classify_with(model_dir, procs, "star", coord_args)
    relayed = await _classify_with(model_dir, procs, "relay", coord_args)
    assert [h.outcome for h in relayed.path.hops] == ["relayed"] * 3  # node -> node, on relay certificates
    assert torch.equal(relayed.probs, star.probs)


async def test_a_relay_certificate_may_call_relay_and_info_but_not_forward(
    tls_swarm: tuple[Path, Path, dict[str, Any], list[Proc]],
) -> None:
    _, certs, _, procs = tls_swarm
    pem = {name: (certs / f"relay.{name}").read_bytes() for name in ("pem", "key")}
    security = SecuritySettings(TOKEN, pem["pem"], pem["key"], (certs / "ca.pem").read_bytes())
    client = NodeClient(address(procs[1]), 64 * 1024 * 1024, security=security)
    try:
        await client.info(2.0)  # the handshake a forwarding node makes
        forward = pb.ForwardRequest(request_id="r", activations=codec.encode(torch.zeros(1, 5, 32)), position=1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.forward(forward, 2.0)
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        step = pb.RelayStep(address=address(procs[1]), position=0, block=1)
        unmaced = pb.RelayRequest(forward=forward, chain=[step], hop_timeout_s=1.0, deadline_s=1.0, plan_mac="x")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.relay(unmaced, 5.0)  # the role passes; the chain still needs the coordinator's MAC
        assert "relay chain refused" in (caught.value.details() or "")
    finally:
        await client.close()
    probe_pem = {name: (certs / f"probe.{name}").read_bytes() for name in ("pem", "key")}
    probe = SecuritySettings(None, probe_pem["pem"], probe_pem["key"], (certs / "ca.pem").read_bytes())
    other = NodeClient(address(procs[1]), 64 * 1024 * 1024, security=probe)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await other.relay(unmaced, 5.0)  # another client certificate of the swarm: refused before the token
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    finally:
        await other.close()


async def test_a_node_without_a_relay_certificate_is_refused_chains_and_requests_still_answer(
    tls_swarm: tuple[Path, Path, dict[str, Any], list[Proc]],
) -> None:
    model_dir, _, coord_args, procs = tls_swarm
    plain = start_nodes([(model_dir, 1)], *coord_args["node_args"])  # TLS and token, no relay certificate
    try:
        swarm = [procs[0], plain[0], procs[2]]
        result = await _classify_with(model_dir, swarm, "relay", coord_args)
        assert result.probs.shape[0] == 2  # answered
        assert any("relay certificate" in h["reason"] for h in result.path.handbacks), result.path.handbacks
    finally:
        stop_all(plain)


@pytest.mark.parametrize(
    ("field", "value"),
    [("rtt_ms", float("nan")), ("rtt_ms", -1.0), ("rtt_ms", 1e9), ("send_ms", float("inf")), ("compute_ms", -5.0)],
)
def test_a_trace_with_impossible_times_is_refused(field: str, value: float) -> None:
    """A lying node's figures never reach the link map: NaN, negative or absurd times void the chain."""
    from types import SimpleNamespace

    from layerswarm.coordinator.relay import _trace_problem
    from layerswarm.wire.relay_plan import digest

    sent = pb.RelayRequest(forward=pb.ForwardRequest(activations=pb.Tensor(data=b"activations")))
    segment = [
        (None, SimpleNamespace(address="a:1", block=0, identity=None)),
        (None, SimpleNamespace(address="b:2", block=1, identity=None)),
    ]
    first = pb.HopTrace(node="a:1", block=0, position=0, compute_ms=1.0, send_ms=2.0, rtt_ms=0.5)
    first.input_sha256, first.output_sha256 = digest(b"activations"), "out-a"
    second = pb.HopTrace(node="b:2", block=1, position=1, compute_ms=1.0, input_sha256="out-a", output_sha256="out-b")
    assert _trace_problem([first, second], segment, 0, sent) is None  # type: ignore[arg-type]
    setattr(first, field, value)
    assert _trace_problem([first, second], segment, 0, sent) == (0, "trace step 0 has impossible times")  # type: ignore[arg-type]


async def test_a_stopping_node_ends_its_idle_relay_streams_instead_of_waiting_out_its_grace(tmp_path: Path) -> None:
    """Relay streams live as long as their sender: a node draining on SIGTERM must not wait its whole
    grace period for them. It finishes the chains in flight, closes each stream, and the coordinator's
    next request goes on without it."""
    served, coord = await _in_process_swarm(
        tmp_path, [FaultSpec()] * 3, node_values={"grace_s": 30.0}, verify_rate=None, min_blocks=1
    )
    try:
        result = await coord.classify(images(), SEQ)  # opens coordinator -> 0 -> 1 -> 2 streams
        assert [h.outcome for h in result.path.hops] == ["relayed"] * 3
        await asyncio.wait_for(served[1].stop(), 10.0)  # far under its 30 s grace
        after = await coord.classify(images(), SEQ)
        assert [h.block for h in after.path.hops if h.block is not None] == [0, 2]  # block 1 skipped
    finally:
        await coord.stop()
        for node in (served[0], served[2]):
            await node.stop()


def _rewriting_later_entries(node: FaultyNode) -> None:
    """Make `node` a lying relay: on each chain's way back it rewrites the next node's trace entry (its
    forwarding time, which steers the coordinator's link map), keeping the digest chain intact."""
    relay = node.relayer.relay

    async def rewriting(request: pb.RelayRequest, handle: Any) -> Any:
        async for event in relay(request, handle):
            if not event.ack and len(event.trace) > 1:
                event.trace[1].send_ms = 5000.0
            yield event

    node.relayer.relay = rewriting  # type: ignore[method-assign]


@pytest.mark.parametrize("keys", [True, False])
async def test_a_relay_rewriting_a_later_nodes_trace_entry_is_caught_by_its_signature(
    tmp_path: Path, keys: bool
) -> None:
    """Each node signs its own entry with a per-boot key its token proof vouches for, so a node the
    entries travel back through cannot rewrite them: the chain is discarded and the request still
    answers, by star from the activation the coordinator held. Nodes without keys (`keys=False`, as
    from before keys existed) cannot be protected that way: the rewritten time gets through."""
    served, coord = await _in_process_swarm(tmp_path, [FaultSpec()] * 3, verify_rate=None, min_blocks=1)
    if not keys:  # nodes that report no key in Info, to a coordinator that meets them afresh
        await coord.stop()
        for node in served:
            node.relayer.signer.public = b""
        coord = Coordinator(coord.settings)
        await coord.start()
        await wait_until(lambda: coord.registry.reachable_depth() == 3, what="all blocks reachable")
    _rewriting_later_entries(served[0])
    try:
        result = await coord.classify(images(), SEQ)
        second, third = (f"127.0.0.1:{n.port}" for n in served[1:])
        if keys:
            (handback,) = result.path.handbacks
            assert "is not signed by its node" in handback["reason"] and "trace step 1" in handback["reason"]
            # Either of the two nodes at the break may be the liar: both are left out of this request
            # (no other node serves their blocks here), and the last block runs star.
            assert [(h.block, h.outcome) for h in result.path.hops if h.block is not None] == [(2, "ok")]
            assert coord.registry.links.per_mb(second, third) is None  # the forged time never got in
        else:
            assert [h.outcome for h in result.path.hops] == ["relayed"] * 3 and not result.path.handbacks
            assert coord.registry.links.per_mb(second, third) is not None
        scraped = generate_latest(coord.metrics.registry).decode()  # what an operator's alert reads
        outcome = "discarded" if keys else "completed"
        assert f'layerswarm_relay_chains_total{{outcome="{outcome}"}} 1.0' in scraped
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
async def test_a_node_lying_in_its_acknowledgement_is_blamed_not_the_node_before_it(
    tmp_path: Path, claimed: float
) -> None:
    """The next node's acknowledgement claims a compute time longer than the whole wait for it (NaN,
    past the trace's bounds, or within them): the node before it hands back naming that node, rather
    than signing an impossible forwarding time of its own (which would void the chain and blame it
    and the node before it) or a link faster than light (which would steer the planner)."""
    served, coord = await _in_process_swarm(tmp_path, [FaultSpec()] * 3, verify_rate=None, min_blocks=1)
    _lying_in_its_acknowledgement(served[1], claimed)
    first, liar = (f"127.0.0.1:{n.port}" for n in served[:2])
    try:
        result = await coord.classify(images(), SEQ)
        (handback,) = result.path.handbacks
        assert "step 1" in handback["reason"] and "acknowledgement" in handback["reason"], handback
        assert coord.registry.nodes[liar].failed >= 1
        assert coord.registry.nodes[first].failed == 0  # the honest node before it is not blamed
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
    blamed at once: by the node before it, which hands back naming it, or, the first node, by the
    coordinator. Before, the coordinator waited on Collect at the last node, which never got the chain,
    for the request's whole deadline, then blamed that last node, and the request failed."""
    served, coord = await _in_process_swarm(
        tmp_path, [FaultSpec()] * 4, verify_rate=None, min_blocks=1, request_timeout_s=6.0
    )
    _ending_the_chain_at_itself(served[liar])
    addresses = [f"127.0.0.1:{n.port}" for n in served]
    try:
        started = time.monotonic()
        result = await coord.classify(images(), SEQ)
        assert time.monotonic() - started < 3.0  # not the request's whole deadline
        assert any(reason in h["reason"] for h in result.path.handbacks), result.path.handbacks
        assert coord.registry.nodes[addresses[liar]].failed >= 1
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
        forward=forward, chain=chain, plan_mac=plan_mac(derive_key(TOKEN), "r", 1, chain), issued_ms=1,
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
    chain's first node (ejected after two requests) while the staller stayed healthy."""
    served, coord = await _in_process_swarm(
        tmp_path, [FaultSpec()] * 4, verify_rate=None, min_blocks=1, request_timeout_s=3.0
    )
    _acknowledging_then_stalling(served[1])
    first, staller = (f"127.0.0.1:{n.port}" for n in served[:2])
    try:
        for _ in range(2):
            result = await coord.classify(images(), SEQ)
            assert any("step 1" in h["reason"] and "DEADLINE_EXCEEDED" in h["reason"] for h in result.path.handbacks)
            assert result.path.hops[0].block == 0 and result.path.hops[0].outcome == "relayed"
        assert coord.registry.nodes[staller].failed == 2
        assert coord.registry.nodes[first].failed == 0 and coord.registry.nodes[first].state.value == "healthy"
    finally:
        await coord.stop()
        for node in served:
            await node.stop()
