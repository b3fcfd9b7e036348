"""Trust: a shared swarm token and mutual TLS between coordinator and nodes."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from layerswarm.cli.probe import probe_grpc
from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, Policy
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.auth import AUTH_KEY, NONCE_KEY, AuthError, CallSigner, info_identity
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from ..swarm import states, wait_until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = SecuritySettings(token="s3cret-swarm-token")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(out)], check=True, capture_output=True)
    return out


def tls(certs: Path, who: str, token: str | None = None) -> SecuritySettings:
    token_file = None
    if token:
        token_file = certs / f"{who}.token"
        token_file.write_text(token + "\n")
    return SecuritySettings.from_files(token_file, certs / f"{who}.pem", certs / f"{who}.key", certs / "ca.pem")


@pytest.fixture
async def node_with(model_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Node]:
    n = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.1, security=request.param))
    await n.start()
    yield n
    await n.stop()


def forward_request() -> pb.ForwardRequest:
    return pb.ForwardRequest(activations=codec.encode(torch.randn(1, 5, 32)), position=0)


@pytest.mark.parametrize("node_with", [TOKEN], indirect=True)
async def test_token_guards_forward_but_not_info_or_health(node_with: Node) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node_with.port}") as channel:
        stub = pb_grpc.BlockNodeStub(channel)
        for call in (
            stub.Forward(forward_request()),
            stub.Forward(forward_request(), metadata=(("authorization", f"Bearer {TOKEN.token}"),)),
            stub.Forward(forward_request(), metadata=((AUTH_KEY, "v1.x.1.nonce-123.mac"),)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call
            assert exc.value.code() is grpc.StatusCode.UNAUTHENTICATED
        stream = stub.ForwardStream(iter([forward_request()]))
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            [r async for r in stream]
        assert exc.value.code() is grpc.StatusCode.UNAUTHENTICATED
        signer = CallSigner(str(TOKEN.token))
        with pytest.raises(AuthError):
            signer.sign("/layerswarm.v1.BlockNode/Forward")  # nothing is signed before the node's proof
        nonce = signer.new_nonce()
        info = stub.Info(pb.InfoRequest(), metadata=((NONCE_KEY, nonce),))  # the handshake: open
        reply = await info
        identity = info_identity(reply)
        assert reply.trace_key and reply.trace_key.hex() in identity  # the proof covers the trace key too
        swapped_key = identity.replace(reply.trace_key.hex(), (b"\x01" * 32).hex())
        assert not CallSigner(str(TOKEN.token)).accept_info(await info.trailing_metadata(), nonce, swapped_key)
        assert signer.accept_info(await info.trailing_metadata(), nonce, identity)  # the node proved the token
        assert not CallSigner("another-token").accept_info(await info.trailing_metadata(), nonce, identity)
        reply = await stub.Forward(forward_request(), metadata=(signer.sign("/layerswarm.v1.BlockNode/Forward"),))
        assert tuple(reply.activations.shape) == (1, 5, 32)
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("node_with", [TOKEN], indirect=True)
async def test_coordinator_with_the_wrong_token_lists_the_node_as_refused(node_with: Node, model_dir: Path) -> None:
    address = f"127.0.0.1:{node_with.port}"
    cases = (
        (SecuritySettings(token="nope"), "ignored", "no valid proof of our swarm token"),
        (SecuritySettings(), "ignored", "requires a swarm token and we have none"),
        (TOKEN, "healthy", "ok"),
    )
    for security, expected, reason in cases:
        coord = Coordinator(
            CoordinatorSettings(
                model_dir=model_dir, peers=(address,), mdns=False, security=security, health_interval_s=0.2
            )
        )
        await coord.start()
        try:
            await wait_until(lambda c=coord, e=expected: states(c).get(address) == e, what=expected)  # type: ignore[misc]
            assert reason in coord.registry.nodes[address].reason
        finally:
            await coord.stop()


async def test_mutual_tls_end_to_end(certs: Path, model_dir: Path) -> None:
    node = Node(
        NodeSettings(
            model_dir=model_dir, block=0, advertise=False, grace_s=0.1, security=tls(certs, "node", token="t0k")
        )
    )
    await node.start()
    address = f"127.0.0.1:{node.port}"
    try:
        good = Coordinator(
            CoordinatorSettings(
                model_dir=model_dir,
                peers=(address,),
                mdns=False,
                security=tls(certs, "coordinator", token="t0k"),
                wire_dtype="fp32",
            )
        )
        plain = Coordinator(
            CoordinatorSettings(model_dir=model_dir, peers=(address,), mdns=False, health_timeout_s=0.5)
        )
        for c in (good, plain):
            await c.start()
        try:
            await wait_until(lambda: states(good).get(address) == "healthy", what="TLS admission")
            result = await good.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL))
            assert result.path.hops[0].outcome == "ok"
            await asyncio.sleep(0.5)
            assert states(plain)[address] == "pending"  # no client certificate: never admitted
            assert "UNAVAILABLE" in plain.registry.nodes[address].reason
        finally:
            for c in (good, plain):
                await c.stop()
        healthy, message = await asyncio.to_thread(probe_grpc, address, 2.0, tls(certs, "coordinator"))
        assert healthy, message
        healthy, _ = await asyncio.to_thread(probe_grpc, address, 1.0)
        assert not healthy
    finally:
        await node.stop()


def test_half_a_tls_configuration_is_refused(certs: Path) -> None:
    with pytest.raises(ValueError, match="all three"):
        SecuritySettings.from_files(None, certs / "node.pem", None, certs / "ca.pem")


@pytest.mark.parametrize("node_with", [TOKEN], indirect=True)
async def test_a_stranger_is_refused_before_its_message_is_read(node_with: Node) -> None:
    """A call without swarm credentials is refused from its metadata, its message never read: a padded
    3 MiB call, which grpc would refuse RESOURCE_EXHAUSTED had it read it (past the receive limit), gets
    UNAUTHENTICATED (before node/guard.py it was read and got RESOURCE_EXHAUSTED). A signed caller is
    still held to the receive limit, sized to the model's largest request (here batch 64 x 5 tokens x 32
    wide, + 1 MiB), not the 64 MiB ceiling."""
    from layerswarm.node.server import receive_limit

    cfg = node_with.manifest.config
    assert node_with.receive_limit == receive_limit(node_with.settings, cfg) < 2 << 20
    most = pb.ForwardRequest(activations=codec.encode(torch.randn(64, cfg.num_tokens, cfg.dim)), position=0)
    padded = pb.ForwardRequest(activations=pb.Tensor(data=b"\0" * (3 << 20)), position=0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node_with.port}") as channel:
        stub = pb_grpc.BlockNodeStub(channel)  # type: ignore[no-untyped-call]
        for request in (most, padded):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Forward(request, timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, refused.value
        signer = CallSigner(str(TOKEN.token))
        nonce = signer.new_nonce()
        info = stub.Info(pb.InfoRequest(), metadata=((NONCE_KEY, nonce),))
        assert signer.accept_info(await info.trailing_metadata(), nonce, info_identity(await info))
        with pytest.raises(grpc.aio.AioRpcError) as too_big:
            await stub.Forward(padded, timeout=10, metadata=(signer.sign("/layerswarm.v1.BlockNode/Forward"),))
        assert too_big.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_receive_limit_covers_a_full_batch_and_keeps_the_configured_ceiling(model_dir: Path) -> None:
    from layerswarm.models.config import ViTConfig
    from layerswarm.node.server import receive_limit

    settings = NodeSettings(model_dir=model_dir, block=0)
    vitb = ViTConfig(image_size=224, patch_size=16, dim=768, depth=12, heads=12)
    assert receive_limit(settings, vitb) == 64 * 197 * 768 * 4 + 64 * 197 * 8 + (1 << 20)  # 39.8 MB
    small = NodeSettings(model_dir=model_dir, block=0, max_message_bytes=1 << 20)
    assert receive_limit(small, vitb) == 1 << 20  # a lower configured ceiling wins


@pytest.mark.parametrize("security", [TOKEN, SecuritySettings()], ids=["token", "no-token"])
@pytest.mark.parametrize("down_s", [0.0, 1.5])
async def test_a_restarted_node_is_readmitted_with_its_new_boot_by_health_checks_alone(
    model_dir: Path, down_s: float, security: SecuritySettings
) -> None:
    """No request tells the coordinator that another process answers: its health checks must, a restart
    quicker than ejection included (before, the coordinator kept the old boot's identity, and with a
    token signed calls with the old boot's challenge until a request failed on them)."""
    first = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.1, security=security))
    await first.start()
    address = f"127.0.0.1:{first.port}"
    settings = CoordinatorSettings(
        model_dir=model_dir, peers=(address,), mdns=False, security=security, health_interval_s=0.2
    )
    coord = Coordinator(settings)
    await coord.start()
    again: Node | None = None
    try:
        await wait_until(lambda: states(coord).get(address) == "healthy", what="admission")
        old_boot = coord.registry.nodes[address].identity.boot_id  # type: ignore[union-attr]
        await first.stop()
        await asyncio.sleep(down_s)
        again = Node(first.settings.model_copy(update={"port": first.port}))
        await again.start()
        new_boot = again.boot_id

        def readmitted() -> bool:
            record = coord.registry.nodes[address]
            boot_id = record.identity.boot_id if record.identity is not None else None
            return record.state.value == "healthy" and boot_id == new_boot

        await wait_until(readmitted, timeout=10, what="re-admission of the new boot")
        assert new_boot != old_boot
        result = await coord.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL))
        assert [hop.outcome for hop in result.path.hops] == ["ok"]  # signed for the new boot at once
    finally:
        await coord.stop()
        if again is not None:
            await again.stop()
