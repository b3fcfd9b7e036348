"""Awaiting one RPC to a node, and the UNAVAILABLE error made here (shared by clients.py and decode_links.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import grpc

T = TypeVar("T")


async def call_rpc(awaitable: Awaitable[T]) -> T:
    """Await one RPC. grpc.aio cancels the calls in flight on a channel that is closed (the health
    monitor drops the channel of a node that left), and the awaiting coroutine then sees
    asyncio.CancelledError although nobody cancelled it: that is an UNAVAILABLE failure of this call,
    which the executor routes around. A real cancellation of the caller still propagates."""
    try:
        return await awaitable
    except asyncio.CancelledError:
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11+
        if task is None or cancelling is None or cancelling():
            raise
        raise unavailable("the call was cancelled under us: the channel to the node closed") from None


def unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
