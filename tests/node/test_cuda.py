"""Blocks on a CUDA GPU, where there is one (CI has none; the device machine does): a CUDA node's replies
agree with the same block on the CPU within the verifier's tolerance, so a coordinator on a CPU that
re-executes every hop keeps an honest GPU swarm instead of convicting it, and Info names the GPU."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, Policy
from layerswarm.coordinator.verification.verifier import TOLERANCE, relative_error
from layerswarm.harness.procs import stop_all
from layerswarm.models.checkpoint import load_block
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from ..conftest import make_model_dir
from ..swarm import coordinator, start_nodes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Wider than the suite's tiny model: rounding differences between CPU and GPU kernels grow with the
# width of the sums, and ViT-B/16's 197 tokens x 768 are what the bench runs on CUDA nodes.
WIDE = {"image_size": 56, "patch_size": 4, "dim": 384, "heads": 6, "depth": 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
async def test_a_cuda_block_agrees_with_the_cpu_block_within_the_verifier_tolerance(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    model_dir = make_model_dir(tmp_path / "wide", **WIDE)  # type: ignore[arg-type]
    node = Node(NodeSettings(model_dir=model_dir, block=1, advertise=False, grace_s=0.2, device="cuda"))
    await node.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
            stub = pb_grpc.BlockNodeStub(channel)
            info = await stub.Info(pb.InfoRequest())
            x = torch.randn(2, 197, 384) * 2
            sent = codec.encode(x, dtype)
            reply = await stub.Forward(pb.ForwardRequest(request_id="t", activations=sent, position=3))
    finally:
        await node.stop()
    assert info.device.startswith("cuda")
    with torch.inference_mode():
        on_cpu = load_block(model_dir, 1)(codec.decode(sent).float(), 3)
    out = codec.decode(reply.activations)
    assert out.device.type == "cpu" and out.dtype == (torch.float32 if dtype == torch.int8 else dtype)  # int8 decodes
    error = relative_error(out, codec.as_sent(on_cpu, dtype))
    # Half the verifier's tolerance: an honest GPU must pass its spot checks with room to spare.
    assert error < TOLERANCE[dtype] / 2, f"{dtype}: relative RMS {error:.3g}"


async def test_a_cpu_coordinator_checking_every_hop_keeps_an_honest_cuda_swarm(tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path / "wide", **WIDE)  # type: ignore[arg-type]
    procs = start_nodes([(model_dir, b) for b in range(4)], "--device", "cuda")
    coord = coordinator(model_dir, procs, hop_timeout_s=30.0, wire_dtype="fp16", verify_rate=1.0)
    await coord.start()
    try:
        images = torch.rand(6, 3, 56, 56)
        opts = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0)
        results = [await coord.router.classify(images[i : i + 1], opts) for i in range(len(images))]
        assert coord.verifier is not None
        counters = coord.verifier.counters
        assert all(r.path.depth == 4 for r in results)
        assert counters.reexecuted >= 4 * len(images) and counters.convicted == 0 and counters.flagged == 0
        assert {r.state.value for r in coord.registry.nodes.values()} == {"healthy"}
    finally:
        await coord.stop()
        stop_all(procs)
