"""A node's hard cases: a failed micro-batch answers every request that waited on it, and SIGTERM lets
requests already in flight finish before the process exits."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from layerswarm.harness.procs import node_cmd, spawn, stop_all
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc


class SlowThenBroken:
    """An engine whose first call is slow (so later requests queue up behind it) and succeeds; then every
    call fails, as a device error would."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.calls, self.batch_sizes = engine, 0, []  # type: ignore[var-annotated]
        self.first_running = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def forward(self, x: np.ndarray, position: int) -> np.ndarray:
        self.calls += 1
        self.batch_sizes.append(x.shape[0])
        if self.calls == 1:
            self.first_running.set()
            time.sleep(0.5)
            return self.engine.forward(x, position)  # type: ignore[no-any-return]
        raise RuntimeError("CUDA error: device-side assert (injected)")


def forward_request(i: int) -> pb.ForwardRequest:
    return pb.ForwardRequest(request_id=f"r{i}", activations=codec.encode(torch.rand(1, 5, 32)), position=0)


async def test_a_failed_micro_batch_reaches_every_waiting_request(model_dir: Path) -> None:
    node = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.1, max_in_flight=64))
    await node.start()
    broken = SlowThenBroken(node.runtime.engine)
    node.runtime.engine = broken  # type: ignore[assignment]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
            stub = pb_grpc.BlockNodeStub(channel)
            first = asyncio.ensure_future(stub.Forward(forward_request(0), timeout=10))
            await asyncio.get_running_loop().run_in_executor(None, broken.first_running.wait, 10)
            queued = [stub.Forward(forward_request(i), timeout=10) for i in range(1, 5)]
            results = await asyncio.gather(first, *queued, return_exceptions=True)
    finally:
        await node.stop()
    assert isinstance(results[0], pb.ForwardResponse)
    assert broken.batch_sizes[1] > 1, broken.batch_sizes  # the queued requests did run as one batch
    for failed in results[1:]:
        assert isinstance(failed, grpc.aio.AioRpcError), failed  # none hangs until its deadline
        assert failed.code() is grpc.StatusCode.INTERNAL and "block compute failed" in (failed.details() or "")


@pytest.mark.slow
def test_sigterm_lets_in_flight_requests_finish(model_dir: Path) -> None:
    """A request that is computing when SIGTERM arrives is answered; then the process exits 0."""
    node = node_cmd(model_dir, 0, "--no-advertise", "--grace", "5")[4:]  # `layerswarm node`'s own arguments
    faulty = [sys.executable, "-m", "layerswarm.harness.faults", *node, "--fault-delay-ms", "3000"]  # a slow node
    proc = spawn("draining-node", faulty)
    try:

        async def call_then_terminate() -> pb.ForwardResponse:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proc.ready['port']}") as channel:
                call = pb_grpc.BlockNodeStub(channel).Forward(forward_request(0), timeout=30)
                await asyncio.sleep(1.0)  # the request is in the node, inside its 3 s of injected delay
                proc.signal(signal.SIGTERM)
                return await call

        reply = asyncio.run(call_then_terminate())
        assert codec.decode(reply.activations).shape == (1, 5, 32)
        assert proc.popen.wait(30) == 0
    finally:
        stop_all([proc])
