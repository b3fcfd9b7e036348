"""A block node over real gRPC on loopback: exact outputs, precise status codes, health, refusals."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.models.checkpoint import block_file, load_block, read_manifest
from layerswarm.node.peers import LinkEstimate
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.stats import ewma
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc


@pytest.fixture
async def node(model_dir: Path) -> AsyncIterator[Node]:
    n = Node(NodeSettings(model_dir=model_dir, block=1, advertise=False, grace_s=0.5, max_in_flight=2))
    await n.start()
    yield n
    await n.stop()


@pytest.fixture
async def stub(node: Node) -> AsyncIterator[pb_grpc.BlockNodeStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        yield pb_grpc.BlockNodeStub(channel)


def request(x: torch.Tensor, position: int = 0, **kw: object) -> pb.ForwardRequest:
    return pb.ForwardRequest(request_id="t", activations=codec.encode(x), position=position, **kw)  # type: ignore


async def test_remote_block_equals_local_block(node: Node, stub: pb_grpc.BlockNodeStub, model_dir: Path) -> None:
    local = load_block(model_dir, 1)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(2, 5, 32).to(dtype)
        reply = await stub.Forward(request(x, position=2))
        out = codec.decode(reply.activations)
        with torch.inference_mode():
            expected = local(x.float(), 2).to(dtype)
        assert out.dtype == dtype and torch.equal(out, expected)
        assert reply.request_id == "t" and reply.compute_ms > 0


async def test_int8_in_int8_back_and_equal_to_local_on_the_dequantized_input(
    stub: pb_grpc.BlockNodeStub, model_dir: Path
) -> None:
    local = load_block(model_dir, 1)
    x = torch.randn(2, 5, 32) * 3
    msg = codec.encode(x, torch.int8)
    reply = await stub.Forward(pb.ForwardRequest(request_id="t", activations=msg, position=1))
    assert reply.activations.dtype == pb.DTYPE_INT8 and len(reply.activations.scales) == 2 * 5 * 4
    with torch.inference_mode():
        expected = local(codec.decode(msg), 1)
    assert torch.equal(codec.decode(reply.activations), codec.as_sent(expected, torch.int8))


async def test_stream_answers_in_order(stub: pb_grpc.BlockNodeStub, model_dir: Path) -> None:
    local = load_block(model_dir, 1)
    xs = [torch.randn(1, 5, 32) for _ in range(3)]
    call = stub.ForwardStream(iter([request(x, position=i) for i, x in enumerate(xs)]))
    outs = [codec.decode(r.activations) async for r in call]
    with torch.inference_mode():
        assert all(torch.equal(o, local(x, i)) for i, (o, x) in enumerate(zip(outs, xs, strict=True)))


def request_int8(scales: bytes) -> pb.ForwardRequest:
    msg = codec.encode(torch.randn(1, 5, 32), torch.int8)
    msg.scales = scales
    return pb.ForwardRequest(request_id="t", activations=msg, position=0)


@pytest.mark.parametrize(
    ("make", "detail"),
    [
        (lambda: request(torch.randn(2, 4, 32)), "dim 1 is 4"),
        (lambda: request(torch.randn(2, 5, 32), position=3), "position 3"),
        (lambda: request(torch.full((1, 5, 32), float("nan"))), "NaN"),
        (lambda: request(torch.randn(65, 5, 32)), "batch size 65"),
        (lambda: pb.ForwardRequest(request_id="t"), "no activations"),
        (lambda: request(torch.randn(1, 5, 32), token_mask=codec.encode(torch.ones(1, 5))), "token_mask"),
        (lambda: pb.ForwardRequest(activations=pb.Tensor(dtype=7, shape=[1, 5, 32], data=b"")), "dtype"),
        (lambda: request_int8(scales=b"\x00\x00\x80\x7f" * 5), "scales must be finite and positive"),
        (lambda: request_int8(scales=b"\x00\x00\x80\x3f" * 4), "needs 5 float32 scales"),
        (lambda: request_int8(scales=b"\x00\x00\x80\xbf" * 5), "scales must be finite and positive"),
        (
            lambda: pb.ForwardRequest(
                activations=pb.Tensor(dtype=pb.DTYPE_INT8, shape=[1, 5, 32], data=bytes(159), scales=bytes(20))
            ),
            "needs 160 bytes",
        ),
    ],
)
async def test_bad_requests_get_invalid_argument(stub: pb_grpc.BlockNodeStub, make, detail: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Forward(make())
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert detail in (exc.value.details() or "")


async def test_overload_gets_resource_exhausted(model_dir: Path) -> None:
    settings = NodeSettings(model_dir=model_dir, block=0, advertise=False, max_in_flight=1, grace_s=0.1)
    n = FaultyNode(settings, FaultSpec(delay_ms=300))
    await n.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{n.port}") as channel:
            stub = pb_grpc.BlockNodeStub(channel)
            x = torch.randn(1, 5, 32)
            results = await asyncio.gather(*(stub.Forward(request(x)) for _ in range(4)), return_exceptions=True)
    finally:
        await n.stop()
    codes = [r.code() for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert codes and all(c is grpc.StatusCode.RESOURCE_EXHAUSTED for c in codes)
    assert any(isinstance(r, pb.ForwardResponse) for r in results)


async def test_info_and_health(node: Node, stub: pb_grpc.BlockNodeStub, model_dir: Path) -> None:
    manifest = read_manifest(model_dir)
    info = await stub.Info(pb.InfoRequest())
    assert (info.family_id, info.model_id, info.block_index) == (manifest.family_id, manifest.model_id, 1)
    assert info.weights_sha256 == manifest.files[block_file(1)]
    assert info.protocol_version == 1 and info.tokens == 5 and info.dim == 32 and info.shuffle_robust
    assert info.boot_id == node.boot_id and info.load.max_in_flight == 2
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="layerswarm.v1.BlockNode"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "layerswarm", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_tampered_weights_stop_the_node_from_starting(model_dir: Path) -> None:
    path = model_dir / block_file(2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    result = run_cli("node", "--model-dir", str(model_dir), "--block", "2", "--no-advertise")
    assert result.returncode == 2
    assert "sha256" in result.stderr and "tampered" in result.stderr and "Traceback" not in result.stderr


def test_bad_block_index_and_missing_dir_are_explained(model_dir: Path, tmp_path: Path) -> None:
    result = run_cli("node", "--model-dir", str(model_dir), "--block", "9", "--no-advertise")
    assert result.returncode == 2 and "block index 9 out of range" in result.stderr
    result = run_cli("node", "--model-dir", str(tmp_path / "nope"), "--block", "0", "--no-advertise")
    assert result.returncode == 2 and "manifest.json" in result.stderr
    result = run_cli("node", "--model-dir", str(model_dir), "--block", "x")
    assert result.returncode == 2 and "--block" in result.stderr


async def test_prometheus_metrics(model_dir: Path) -> None:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, metrics_port=port, grace_s=0.1))
    await n.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{n.port}") as channel:
            stub = pb_grpc.BlockNodeStub(channel)
            await stub.Forward(request(torch.randn(1, 5, 32)))
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Forward(request(torch.randn(1, 4, 32)))
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    finally:
        await n.stop()
    assert 'layerswarm_node_requests_total{rpc="Forward"} 2.0' in text
    assert 'layerswarm_node_errors_total{code="INVALID_ARGUMENT"} 1.0' in text
    assert "layerswarm_node_forward_seconds_count 1.0" in text and "layerswarm_node_in_flight 0.0" in text


async def test_probe_command_reads_grpc_health(node: Node) -> None:
    from layerswarm.cli.probe import probe_grpc

    healthy, message = await asyncio.to_thread(probe_grpc, f"127.0.0.1:{node.port}", 2.0)
    assert healthy and message.endswith("SERVING")
    await node.health.enter_graceful_shutdown()
    healthy, message = await asyncio.to_thread(probe_grpc, f"127.0.0.1:{node.port}", 2.0)
    assert not healthy and "NOT_SERVING" in message
    healthy, message = await asyncio.to_thread(probe_grpc, "127.0.0.1:1", 1.0)
    assert not healthy and "UNAVAILABLE" in message


@pytest.mark.parametrize("engine", ["torch", "numpy"])
async def test_micro_batching_merges_queued_requests_and_splits_results(model_dir: Path, engine: str) -> None:
    from layerswarm.models.checkpoint import read_manifest as manifest_of
    from layerswarm.node.engines import load_engine
    from layerswarm.node.runtime import BlockRuntime

    manifest = manifest_of(model_dir)
    runtime = BlockRuntime(load_engine(model_dir, 1, manifest, engine, "cpu"), 1, manifest, micro_batch=True)
    local = load_block(model_dir, 1)
    xs = [torch.randn(b, 5, 32) for b in (1, 2, 1, 3)]
    positions = [0, 0, 2, 0]
    results = await asyncio.gather(*(runtime.forward(x.numpy(), p) for x, p in zip(xs, positions, strict=True)))
    runtime.close()
    # The first runs at once on the idle block; the three that queued behind it run as two batches:
    # position 0 (two requests merged) and position 2.
    assert runtime.served == 4 and runtime.batches == 3
    with torch.inference_mode():
        for (out, _ms), x, p in zip(results, xs, positions, strict=True):
            assert out.shape == x.shape
            assert torch.allclose(torch.from_numpy(out), local(x, p), atol=1e-5)


async def test_micro_batching_off_runs_each_request_alone(model_dir: Path) -> None:
    from layerswarm.models.checkpoint import read_manifest as manifest_of
    from layerswarm.node.engines import load_engine
    from layerswarm.node.runtime import BlockRuntime

    manifest = manifest_of(model_dir)
    runtime = BlockRuntime(load_engine(model_dir, 1, manifest, "numpy", "cpu"), 1, manifest, micro_batch=False)
    await asyncio.gather(*(runtime.forward(torch.randn(1, 5, 32).numpy(), 0) for _ in range(4)))
    runtime.close()
    assert runtime.served == 4 and runtime.batches == 4


async def test_random_requests_get_ok_or_invalid_argument_never_unknown(node: Node) -> None:
    """Property test of request validation: whatever arrives, the answer is OK or INVALID_ARGUMENT."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    requests = st.builds(
        pb.ForwardRequest,
        request_id=st.text(max_size=8),
        activations=st.builds(
            pb.Tensor,
            dtype=st.integers(0, 5),
            shape=st.lists(st.integers(-2, 70), max_size=4),
            data=st.binary(max_size=20000),
        ),
        position=st.integers(-3, 5),
        reply_dtype=st.integers(0, 5),
    )
    seen: list[grpc.StatusCode] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        stub = pb_grpc.BlockNodeStub(channel)

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(requests)
        def check(req: pb.ForwardRequest) -> None:
            seen.append(asyncio.run_coroutine_threadsafe(_status(stub, req), loop).result(10))

        loop = asyncio.get_running_loop()
        await asyncio.to_thread(check)
    assert set(seen) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, set(seen)
    assert grpc.StatusCode.INVALID_ARGUMENT in seen


async def _status(stub: pb_grpc.BlockNodeStub, req: pb.ForwardRequest) -> grpc.StatusCode:
    try:
        await stub.Forward(req, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_nodes_link_estimates_are_the_shared_ewma() -> None:
    """Send time, bandwidth and probed RTT of a node's links average as wire.stats.ewma does everywhere:
    the first sample starts each, later ones move it by ALPHA."""
    link = LinkEstimate()
    link.observe(1_000_000, 10.0)  # 1 MB in 10 ms: 800 Mbit/s
    assert (link.send_ms, link.mbps, link.samples) == (10.0, 800.0, 1)
    link.observe(1_000_000, 20.0)
    assert link.send_ms == pytest.approx(ewma(10.0, 20.0, LinkEstimate.ALPHA)) == pytest.approx(12.0)
    assert link.mbps == pytest.approx(ewma(800.0, 400.0, LinkEstimate.ALPHA)) == pytest.approx(720.0)
    link.observe_rtt(5.0)
    link.observe_rtt(10.0)
    assert link.rtt_ms == pytest.approx(ewma(5.0, 10.0, LinkEstimate.ALPHA)) == pytest.approx(6.0)
