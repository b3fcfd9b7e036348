"""The coordinator's node client: a channel closed under a call in flight (the node left and its channel
was dropped) is that call's UNAVAILABLE failure, never a CancelledError that escapes the request (which
uvicorn would answer with a plain-text 500)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from layerswarm.coordinator.membership.clients import ClientPool
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb


@pytest.fixture
async def slow_node(family_dirs: list[Path]) -> AsyncIterator[str]:
    node = FaultyNode(
        NodeSettings(model_dir=family_dirs[0], block=0, advertise=False, grace_s=0.1), FaultSpec(delay_ms=1500)
    )
    await node.start()
    yield f"127.0.0.1:{node.port}"
    await node.stop()


def request() -> pb.ForwardRequest:
    return pb.ForwardRequest(request_id="r", activations=codec.encode(torch.randn(1, 5, 32)), position=0)


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_a_channel_closed_under_a_call_is_unavailable_not_cancelled(slow_node: str, transport: str) -> None:
    pool = ClientPool(transport=transport)
    call = asyncio.ensure_future(pool.get(slow_node).forward(request(), timeout=10))
    await asyncio.sleep(0.5)  # the call is in flight (the node sleeps 1.5 s)
    await pool.drop(slow_node)  # as the health monitor does when a node leaves
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_cancelling_the_caller_still_cancels(slow_node: str) -> None:
    pool = ClientPool()
    call = asyncio.ensure_future(pool.get(slow_node).forward(request(), timeout=10))
    await asyncio.sleep(0.5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await pool.close()
