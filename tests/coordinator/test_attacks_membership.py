"""Attacks on membership and authentication, tried as a stranger on the LAN would.

The mDNS attacks run only inside a private network namespace (scripts/test), with real zeroconf in
the test as the attacker: forged goodbyes (a static peer included), forged re-adverts under another
family, an advert flood. The others need no multicast: token theft and replay, an impostor node
without the token, and a node certificate used as a client. Each asserts what the defence keeps
true, so it fails when the defence is removed.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from layerswarm.cli.probe import probe_grpc
from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, Policy
from layerswarm.coordinator.membership.records import NodeEvent
from layerswarm.harness.forge import MdnsAttacker, RecordingImpostor
from layerswarm.harness.netns import in_private_netns, loopback_multicast_ready
from layerswarm.models.checkpoint import read_manifest
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.auth import CHALLENGE_KEY, NONCE_KEY, PROOF_KEY, TIME_KEY, CallSigner, info_identity
from layerswarm.wire.discovery import instance_name
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from ..swarm import states, wait_until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "swarm-token-of-the-real-swarm"
needs_mdns = pytest.mark.skipif(
    not (in_private_netns() and loopback_multicast_ready()),
    reason="mDNS attacks run only inside a private network namespace with loopback multicast: use scripts/test",
)


# --- helpers ---------------------------------------------------------------------------------------------


async def start_node(model_dir: Path, block: int, advertise: bool = True, token: str | None = None) -> Node:
    security = SecuritySettings(token=token)
    node = Node(NodeSettings(model_dir=model_dir, block=block, advertise=advertise, grace_s=0.1, security=security))
    await node.start()
    return node


def address(node: Node) -> str:
    return f"127.0.0.1:{node.port}"


def coordinator(
    model_dir: Path, peers: tuple[str, ...] = (), mdns: bool = True, token: str | None = None, timeout_s: float = 0.3
) -> Coordinator:
    settings = CoordinatorSettings(
        model_dir=model_dir,
        peers=peers,
        mdns=mdns,
        health_interval_s=0.2,
        health_timeout_s=timeout_s,
        hop_timeout_s=1.0,
        security=SecuritySettings(token=token),
    )
    return Coordinator(settings)


def record_events(coord: Coordinator) -> list[NodeEvent]:
    """Every state change from now on (the registry's own log feed)."""
    events: list[NodeEvent] = []
    previous = coord.registry.on_change

    def sink(event: NodeEvent) -> None:
        events.append(event)
        if previous is not None:
            previous(event)

    coord.registry.on_change = sink
    return events


async def classify_ok(coord: Coordinator) -> None:
    result = await coord.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL))
    assert [h.outcome for h in result.path.hops] == ["ok"] * len(result.path.hops) and result.path.hops


@pytest.fixture
async def attacker() -> AsyncIterator[MdnsAttacker]:
    atk = MdnsAttacker()
    yield atk
    await atk.close()


async def hold_for(seconds: float, check: Any) -> None:
    """Assert `check()` at every sample for `seconds` (an attack must not win even briefly)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        check()
        await asyncio.sleep(0.05)


# --- mDNS attacks --------------------------------------------------------------------------------------


@needs_mdns
async def test_forged_goodbyes_remove_no_node(family_dirs: list[Path], attacker: MdnsAttacker) -> None:
    family = read_manifest(family_dirs[0]).family_id
    nodes = [await start_node(family_dirs[0], 0), await start_node(family_dirs[1], 1)]
    static = await start_node(family_dirs[0], 2, advertise=False)
    coord = coordinator(family_dirs[0], peers=(address(static),))
    await coord.start()
    addrs = [address(n) for n in (*nodes, static)]
    try:
        await wait_until(lambda: [states(coord).get(a) for a in addrs] == ["healthy"] * 3, what="three healthy")
        events = record_events(coord)
        forged = [
            attacker.info(f"forged-{i}", "127.0.0.1", int(a.rpartition(":")[2]), family) for i, a in enumerate(addrs)
        ]
        attacker.send(forged, ttl=120)  # first make the coordinator hear of each node under a forged name
        await wait_until(
            lambda: all(any(h.startswith("mdns:forged") for h in coord.registry.nodes[a].hints) for a in addrs),
            what="forged adverts heard",
        )
        real_names = [
            attacker.info(instance_name(n.manifest.model_id, n.settings.block, n.boot_id), "127.0.0.1", n.port, family)
            for n in nodes
        ]
        # Goodbyes for the forged names and the real nodes' own names, repeated as an attacker would (a
        # datagram can be lost under load). The forged hints never come back once processed; a real
        # node may answer the coordinator's next query and put its own hint back, so only those count.
        for _ in range(15):
            attacker.send(forged + real_names, ttl=0)
            try:
                await wait_until(
                    lambda: all(
                        not any(h.startswith("mdns:forged") for h in coord.registry.nodes[a].hints) for a in addrs
                    ),
                    timeout=1.0,
                    what="every forged name's goodbye processed",
                )
                break
            except AssertionError:
                continue
        else:
            raise AssertionError("the forged goodbyes were never processed")

        def all_healthy() -> None:
            assert [states(coord).get(a) for a in addrs] == ["healthy"] * 3

        await hold_for(1.5, all_healthy)  # several health rounds: verified, still answering, kept
        assert not [e for e in events if e.address in addrs], "a forged goodbye changed a node's state"
        assert coord.registry.nodes[address(static)].hints == {"static": None}
        await classify_ok(coord)
    finally:
        await coord.stop()
        for n in (*nodes, static):
            await n.stop()


@needs_mdns
async def test_forged_adverts_of_another_family_flip_no_node(family_dirs: list[Path], attacker: MdnsAttacker) -> None:
    nodes = [await start_node(family_dirs[0], b) for b in range(3)]
    coord = coordinator(family_dirs[0])
    await coord.start()
    addrs = [address(n) for n in nodes]
    try:
        await wait_until(lambda: [states(coord).get(a) for a in addrs] == ["healthy"] * 3, what="three healthy")
        events = record_events(coord)
        forged = [attacker.info(f"evil-{i}", "127.0.0.1", n.port, "fam-evil") for i, n in enumerate(nodes)]
        stranger = attacker.info("evil-new", "127.0.0.1", 9, "fam-evil")  # an address nobody vouched for
        for _ in range(3):  # re-adverts, over and over
            attacker.send([*forged, stranger], ttl=120)
            await asyncio.sleep(0.2)
        await wait_until(
            lambda: all("fam-evil" in coord.registry.nodes[a].hints.values() for a in addrs),
            what="forged adverts heard",
        )

        def all_healthy() -> None:
            assert [states(coord).get(a) for a in addrs] == ["healthy"] * 3

        await hold_for(1.0, all_healthy)
        assert not [e for e in events if e.address in addrs], "a forged advert changed a node's state"
        assert "not contacted" in coord.registry.nodes["127.0.0.1:9"].reason  # strangers are left alone
        await classify_ok(coord)
    finally:
        await coord.stop()
        for n in nodes:
            await n.stop()


@needs_mdns
async def test_advert_flood_is_bounded_and_starves_nothing(family_dirs: list[Path], attacker: MdnsAttacker) -> None:
    family = read_manifest(family_dirs[0]).family_id
    nodes = [await start_node(family_dirs[0], b) for b in range(2)]
    coord = coordinator(family_dirs[0], timeout_s=1.0)  # a starved CPU must not pass for the flood's effect
    await coord.start()
    addrs = [address(n) for n in nodes]
    reg = coord.registry
    try:
        await wait_until(lambda: [states(coord).get(a) for a in addrs] == ["healthy"] * 2, what="two healthy")
        events = record_events(coord)
        elsewhere = [attacker.info(f"flood-{i}", f"10.77.{i // 200}.{i % 200 + 1}", 5000, family) for i in range(400)]
        one_host = [attacker.info(f"flood-lo-{i}", "127.0.0.1", 20000 + i, family) for i in range(200)]
        sizes: list[int] = []
        for start in range(0, 600, 100):  # the flood, in bursts
            attacker.send((elsewhere + one_host)[start : start + 100], ttl=120)
            for _ in range(5):
                sizes.append(len(reg.nodes))
                await asyncio.sleep(0.1)
        await hold_for(2.0, lambda: sizes.append(len(reg.nodes)))
        assert max(sizes) <= len(addrs) + reg.max_unproven, f"registry grew to {max(sizes)}"
        per_host = sum(1 for r in reg.nodes.values() if r.host == "127.0.0.1" and not r.proven)
        assert per_host <= reg.max_unproven_per_host
        assert coord.watch.discovery is not None and coord.watch.discovery.dropped > 0  # the bounds did bite
        assert len(coord.watch.discovery._addresses) <= 1024 and len(coord.watch.discovery._queue) <= 128
        assert not [e for e in events if e.address in addrs], "the flood disturbed a real node"
        await classify_ok(coord)
        late = await start_node(family_dirs[1], 2)  # a real node joining after the flood still gets in
        try:
            await wait_until(lambda: states(coord).get(address(late)) == "healthy", 30, "late node admitted")
        finally:
            await late.stop()
    finally:
        await coord.stop()
        for n in nodes:
            await n.stop()


# --- token theft, replay, impostors -------------------------------------------------------------------


def forward_request() -> pb.ForwardRequest:
    return pb.ForwardRequest(activations=codec.encode(torch.randn(1, 5, 32)), position=0)


async def real_info(node: Node) -> tuple[pb.NodeInfo, tuple[tuple[str, str], ...]]:
    async with grpc.aio.insecure_channel(address(node)) as channel:
        call = pb_grpc.BlockNodeStub(channel).Info(pb.InfoRequest(), metadata=((NONCE_KEY, "a" * 24),))
        info = await call
        trailing = tuple((k, str(v)) for k, v in await call.trailing_metadata())
    return info, trailing


class Refusals(list[str]):
    """What Forward and ForwardStream answered; true when both were UNAUTHENTICATED (the assertion's
    message then says what else came back)."""

    def __bool__(self) -> bool:
        return all(outcome == "UNAUTHENTICATED" for outcome in self)


async def refused(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> Refusals:
    stub = pb_grpc.BlockNodeStub(channel)
    outcomes = Refusals()
    for call in (
        stub.Forward(forward_request(), metadata=metadata),
        _drain(stub.ForwardStream(iter([forward_request()]), metadata=metadata)),
    ):
        try:
            await call
            outcomes.append("answered")
        except grpc.aio.AioRpcError as exc:
            outcomes.append(
                exc.code().name
                if exc.code() is grpc.StatusCode.UNAUTHENTICATED
                else f"{exc.code().name}: {exc.details()}"
            )
    return outcomes


async def _drain(stream: Any) -> list[Any]:
    return [r async for r in stream]


async def test_token_theft_and_impostor_without_the_token(model_dir: Path) -> None:
    real = await start_node(model_dir, 0, advertise=False, token=TOKEN)
    info, trailing = await real_info(real)
    assert dict(trailing)[PROOF_KEY]  # a proof exists, made for another nonce: the impostor replays it
    impostor = RecordingImpostor(info, trailing)
    server = grpc.aio.server()
    pb_grpc.add_BlockNodeServicer_to_server(impostor, server)  # type: ignore[no-untyped-call]
    fake_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fake = f"127.0.0.1:{fake_port}"
    coord = coordinator(model_dir, peers=(fake, address(real)), mdns=False, token=TOKEN)
    await coord.start()
    try:
        await wait_until(lambda: states(coord) == {fake: "ignored", address(real): "healthy"}, what="impostor refused")
        assert "no valid proof of our swarm token" in coord.registry.nodes[fake].reason
        await classify_ok(coord)
        await asyncio.sleep(0.5)  # a few more health rounds: the impostor still gets nothing usable
        assert impostor.received and {m for m, _ in impostor.received} == {"Info"}  # never sent work
        sent = " ".join(f"{k}={v}" for _, md in impostor.received for k, v in md)
        assert TOKEN not in sent and "authorization" not in sent and "x-layerswarm-auth" not in sent
        async with grpc.aio.insecure_channel(address(real)) as channel:
            for _, metadata in impostor.received:  # replay everything it captured against the real node
                assert (outcomes := await refused(channel, metadata)), outcomes
    finally:
        await coord.stop()
        await server.stop(0)
        await real.stop()


class PaddedStranger(pb_grpc.BlockNodeServicer):
    """A stranger answering Info with a reply padded to `pad` bytes (its model id), as anyone on the LAN
    may, to every coordinator that checks the address some advert named."""

    def __init__(self, family_id: str, pad: int) -> None:
        self.reply = pb.NodeInfo(family_id=family_id, model_id="x" * pad, protocol_version=1)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        return self.reply


async def test_a_strangers_padded_info_reply_is_refused_at_a_small_size_limit(model_dir: Path) -> None:
    """Info and health checks go to strangers too, every round: their replies are refused past a small
    limit (1 MiB) instead of the activations' 64 MiB, so a stranger cannot make the coordinator take in
    tens of MB per check (before: 8 strangers padding to 48 MB grew it by 199 MB within 4 s on loopback,
    bounded only by bandwidth and the health timeout). The real node is untouched."""
    real = await start_node(model_dir, 0, advertise=False, token=TOKEN)
    server = grpc.aio.server()
    pb_grpc.add_BlockNodeServicer_to_server(PaddedStranger(read_manifest(model_dir).family_id, 2 << 20), server)  # type: ignore[no-untyped-call]
    fake = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    coord = coordinator(model_dir, peers=(fake, address(real)), mdns=False, token=TOKEN)
    await coord.start()
    try:
        await wait_until(
            lambda: (
                "RESOURCE_EXHAUSTED" in coord.registry.nodes[fake].reason and states(coord)[address(real)] == "healthy"
            ),
            what="the padded reply refused, the real node admitted",
        )
        assert states(coord)[fake] == "pending"  # never admitted, and listed with why
        await classify_ok(coord)
    finally:
        await coord.stop()
        await server.stop(0)
        await real.stop()


async def test_a_strangers_absurd_clock_is_refused_and_stops_nothing(model_dir: Path) -> None:
    """A stranger's Info reply whose clock (`x-layerswarm-time`) has 5,000 digits, past what int() takes
    (4,300): before, the coordinator's signer raised ValueError on it, and the first health round, which
    start() awaits, took the whole coordinator down ("layerswarm coordinator: error: Exceeds the limit").
    Now the clock is ignored, the stranger listed as refused, and the real node serves."""
    real = await start_node(model_dir, 0, advertise=False, token=TOKEN)
    info, trailing = await real_info(real)
    absurd = tuple((k, "9" * 5000 if k == TIME_KEY else v) for k, v in trailing)
    server = grpc.aio.server()
    pb_grpc.add_BlockNodeServicer_to_server(RecordingImpostor(info, absurd), server)  # type: ignore[no-untyped-call]
    fake = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    coord = coordinator(model_dir, peers=(fake, address(real)), mdns=False, token=TOKEN)
    try:
        await coord.start()
        await wait_until(lambda: states(coord) == {fake: "ignored", address(real): "healthy"}, what="stranger refused")
        assert "no valid proof of our swarm token" in coord.registry.nodes[fake].reason
        await classify_ok(coord)
        assert coord.watch.monitor._periodic.errors == 0  # no health round fails on it either
    finally:
        await coord.stop()
        await server.stop(0)
        await real.stop()


async def test_a_signed_call_with_an_absurd_timestamp_is_unauthenticated(model_dir: Path) -> None:
    """The node's challenge is public (every Info reply carries it): a stranger sending it with a
    timestamp of 4,400 digits got UNKNOWN ("Unexpected ValueError", a traceback in the node's log) instead
    of a refusal."""
    node = await start_node(model_dir, 0, advertise=False, token=TOKEN)
    try:
        _, trailing = await real_info(node)
        header = f"v1.{dict(trailing)[CHALLENGE_KEY]}.{'9' * 4400}.{'a' * 24}.{'0' * 64}"
        async with grpc.aio.insecure_channel(address(node)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refusal:
                await pb_grpc.BlockNodeStub(channel).Forward(
                    forward_request(), metadata=(("x-layerswarm-auth", header),)
                )
        assert refusal.value.code() is grpc.StatusCode.UNAUTHENTICATED, refusal.value
        assert "malformed" in str(refusal.value.details())
    finally:
        await node.stop()


async def test_sniffed_credentials_cannot_be_replayed(model_dir: Path) -> None:
    a = await start_node(model_dir, 0, advertise=False, token=TOKEN)
    b = await start_node(model_dir, 0, advertise=False, token=TOKEN)
    try:
        signer = CallSigner(TOKEN)
        async with grpc.aio.insecure_channel(address(a)) as ca, grpc.aio.insecure_channel(address(b)) as cb:
            nonce = signer.new_nonce()
            call = pb_grpc.BlockNodeStub(ca).Info(pb.InfoRequest(), metadata=((NONCE_KEY, nonce),))
            reply = await call
            identity = info_identity(reply)
            assert signer.accept_info(await call.trailing_metadata(), nonce, identity)
            header = signer.sign("/layerswarm.v1.BlockNode/Forward")
            await pb_grpc.BlockNodeStub(ca).Forward(forward_request(), metadata=(header,))  # the genuine call
            with pytest.raises(grpc.aio.AioRpcError) as again:  # the same credentials, sniffed and replayed
                await pb_grpc.BlockNodeStub(ca).Forward(forward_request(), metadata=(header,))
            assert again.value.code() is grpc.StatusCode.UNAUTHENTICATED and "replayed" in str(again.value.details())
            assert (outcomes := await refused(cb, (header,))), outcomes  # ... or sent to another node
            stream_header = signer.sign("/layerswarm.v1.BlockNode/Forward")  # signed for Forward only
            with pytest.raises(grpc.aio.AioRpcError) as other_method:
                await _drain(
                    pb_grpc.BlockNodeStub(ca).ForwardStream(iter([forward_request()]), metadata=(stream_header,))
                )
            assert other_method.value.code() is grpc.StatusCode.UNAUTHENTICATED
            metadata = dict(await call.trailing_metadata())
            assert set(metadata) >= {CHALLENGE_KEY, TIME_KEY, PROOF_KEY}
    finally:
        await a.stop()
        await b.stop()


# --- mTLS roles ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(out), "pi1"], check=True, capture_output=True)
    yield out


def tls(certs: Path, who: str) -> SecuritySettings:
    return SecuritySettings.from_files(None, certs / f"{who}.pem", certs / f"{who}.key", certs / "ca.pem")


async def test_node_certificate_cannot_drive_nodes(certs: Path, model_dir: Path) -> None:
    node = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.1, security=tls(certs, "node")))
    await node.start()
    try:
        for who, admitted, why in (
            ("coordinator", "healthy", "ok"),
            ("node", "pending", "UNAVAILABLE"),  # TLS: a serverAuth-only certificate is no client
            ("node-pi1", "pending", "UNAVAILABLE"),
            ("probe", "pending", "PERMISSION_DENIED"),  # a client, but only for the health service
        ):
            coord = Coordinator(
                CoordinatorSettings(model_dir=model_dir, peers=(address(node),), mdns=False, security=tls(certs, who))
            )
            await coord.start()
            try:
                await wait_until(lambda c=coord: c.registry.nodes[address(node)].checked, what="checked")  # type: ignore[misc]
                if admitted == "pending":
                    await asyncio.sleep(0.5)
                assert states(coord)[address(node)] == admitted, who
                assert why in coord.registry.nodes[address(node)].reason, who
            finally:
                await coord.stop()
        healthy, message = await asyncio.to_thread(probe_grpc, address(node), 2.0, tls(certs, "probe"))
        assert healthy, message  # probes on a node device need neither the node's nor the coordinator's key
        healthy, message = await asyncio.to_thread(probe_grpc, address(node), 2.0, tls(certs, "node"))
        assert not healthy, message
    finally:
        await node.stop()


async def test_coordinator_certificate_cannot_pose_as_a_node(certs: Path, model_dir: Path) -> None:
    impostor = Node(
        NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.1, security=tls(certs, "coordinator"))
    )
    await impostor.start()
    coord = Coordinator(
        CoordinatorSettings(
            model_dir=model_dir, peers=(address(impostor),), mdns=False, security=tls(certs, "coordinator")
        )
    )
    await coord.start()
    try:
        await asyncio.sleep(0.8)
        assert states(coord)[address(impostor)] == "pending"  # TLS refuses a server without serverAuth
        assert "UNAVAILABLE" in coord.registry.nodes[address(impostor)].reason
    finally:
        await coord.stop()
        await impostor.stop()


async def test_rotation_keeps_the_ca_and_old_and_new_leaves_work_together(tmp_path: Path, model_dir: Path) -> None:
    make = ["bash", str(ROOT / "deploy" / "make-certs.sh"), str(tmp_path)]
    subprocess.run(make, check=True, capture_output=True)
    ca, old_node = (tmp_path / "ca.pem").read_bytes(), tls(tmp_path, "node")
    subprocess.run(make, check=True, capture_output=True)  # rotate: leaves replaced, CA kept
    assert (tmp_path / "ca.pem").read_bytes() == ca and tls(tmp_path, "node").tls_cert != old_node.tls_cert
    node = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.1, security=old_node))
    await node.start()  # a node not yet restarted, with its old leaf
    coord = Coordinator(
        CoordinatorSettings(
            model_dir=model_dir, peers=(address(node),), mdns=False, security=tls(tmp_path, "coordinator")
        )
    )
    await coord.start()
    try:
        await wait_until(lambda: states(coord)[address(node)] == "healthy", what="old leaf admitted by new leaf")
    finally:
        await coord.stop()
        await node.stop()
