"""The coordinator's node client: a channel closed under a call in flight (the node left and its channel
was dropped) is that call's UNAVAILABLE failure, never a CancelledError that escapes the request (which
uvicorn would answer with a plain-text 500). A decode step past its timeout is asyncio.TimeoutError and
its call is never reused; a cancelled caller still sees its cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from layerswarm.coordinator.membership.clients import ClientPool
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

from ..lm_nodes import decode_request, make_lm_dir


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


@pytest.fixture
async def stalling_decoder(tmp_path: Path) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A decoder node whose decode steps (start > 0) wait until the event is set: a node that stalls."""
    make_lm_dir(tmp_path / "lm")
    node = Node(NodeSettings(model_dir=tmp_path / "lm", block=0, advertise=False, grace_s=0.1))
    assert node.decode is not None
    go = asyncio.Event()
    real = node.decode.decode

    async def stalled(request: pb.DecodeRequest, caller: object) -> pb.DecodeResponse:
        if request.start > 0:
            await go.wait()
        return await real(request, caller)  # type: ignore[arg-type]

    node.decode.decode = stalled  # type: ignore[method-assign,assignment]
    await node.start()
    yield f"127.0.0.1:{node.port}", go
    go.set()
    await node.stop()


async def test_a_decode_step_past_its_timeout_times_out_and_its_call_is_not_reused(
    stalling_decoder: tuple[str, asyncio.Event],
) -> None:
    address, go = stalling_decoder
    pool = ClientPool()
    link = pool.get(address).decode_link()
    try:
        assert (await link.step(decode_request("s", 0, torch.randn(1, 3, 32)), 5)).length == 3
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await link.step(decode_request("s", 3, torch.randn(1, 1, 32)), 0.3)
        assert time.monotonic() - started < 1.5
        go.set()
        # A new call: the stream belongs to the timed-out one (PERMISSION_DENIED until the node sees that call
        # end, then NOT_FOUND: freed with it). Over the old call this step would succeed.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await link.step(decode_request("s", 3, torch.randn(1, 1, 32)), 5)
        refusals = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED)
        assert caught.value.code() in refusals
    finally:
        link.close()
        await pool.close()


async def test_cancelling_a_decode_step_cancels_it_not_times_it_out(
    stalling_decoder: tuple[str, asyncio.Event],
) -> None:
    address, _ = stalling_decoder
    pool = ClientPool()
    link = pool.get(address).decode_link()
    try:
        await link.step(decode_request("s", 0, torch.randn(1, 2, 32)), 5)
        step = asyncio.ensure_future(link.step(decode_request("s", 2, torch.randn(1, 1, 32)), 0.5))
        await asyncio.sleep(0.1)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        await asyncio.sleep(0.6)  # past the step's timeout: its timer was cancelled with it, nothing fires
    finally:
        link.close()
        await pool.close()
