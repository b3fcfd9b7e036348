"""A generation stream's own DecodeStream call to one node (DecodeLink), and what a step refused inside
such a call raises (RefusedInStream). The coordinator's streams share one DecodeBatchStream call per node
instead (decode_mux.py); a DecodeLink serves a node without it, and the bench's lone-stream probes."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc

from layerswarm.wire.v1 import block_pb2 as pb

from .rpc import call_rpc, unavailable


class DecodeClient(Protocol):
    """What a link needs of its node's client: clients.py's NodeClient, which makes the links (named here,
    not imported from there: clients.py imports this module and decode_mux.py)."""

    address: str
    transport: str  # "stream", or "unary": a Decode call per step
    block: Any  # the node's BlockNode stub

    async def decode(self, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse: ...

    def _signed(self, method: str) -> tuple[tuple[str, str], ...]: ...

    def _learn(self, exc: grpc.aio.AioRpcError) -> None: ...


class StepLink(Protocol):
    """A generation stream's way to one node (DecodeLink, decode_mux.py's MuxLink)."""

    async def step(self, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse: ...

    def close(self) -> None: ...


class DecodeLink:
    """One DecodeStream call to one node, for one generation stream's steps (replies come in order).

    Opened on the first step; a call that failed, timed out or was cancelled is never reused (its state
    is unknown): the next step opens a new one, and the node, which freed what the old call opened,
    answers it FAILED_PRECONDITION or NOT_FOUND, which the caller turns into a rebuild. A node older than
    DecodeStream (UNIMPLEMENTED) gets unary Decode calls from then on."""

    def __init__(self, client: DecodeClient) -> None:
        self.client = client
        self._call: Any = None
        self._unary = client.transport == "unary"

    async def step(self, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
        if self._unary:
            return await self.client.decode(request, timeout)
        if self._call is None or self._call.done():
            metadata = self.client._signed("DecodeStream")
            try:
                self._call = self.client.block.DecodeStream(metadata=metadata)
            except grpc.aio.UsageError as exc:  # the pool closed this client (the node left): it is gone for us
                raise unavailable(f"decode stream not opened: {exc}") from exc
        call = self._call
        try:
            return await _exchange_within(call, request, timeout)
        except RefusedInStream:
            raise  # one step refused; the call goes on for the next
        except grpc.aio.AioRpcError as exc:
            self._drop()
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                self._unary = True
                return await self.client.decode(request, timeout)
            self.client._learn(exc)
            raise
        except asyncio.InvalidStateError as exc:  # the call ended under us (the node went away)
            self._drop()
            raise unavailable(f"stream closed: {exc}") from exc
        except BaseException:
            self._drop()
            raise

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def close(self) -> None:
        """End the call: the node frees every stream opened over it."""
        self._drop()


class RefusedInStream(grpc.aio.AioRpcError):  # type: ignore[misc]
    """One step refused inside a DecodeStream (its reply's `refused` status name): the call stays open."""


async def _exchange_within(call: Any, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
    """One step over the call, given up after `timeout` (asyncio.TimeoutError) by cancelling the call from a
    timer: what asyncio.wait_for does, without the task it makes per step (a decode hop is a few hundred
    microseconds on loopback, and every hop of every token pays it)."""
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        call.cancel()

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await call_rpc(_decode_exchange(call, request))
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        if expired:  # our own cancel, seen as the call's end
            raise asyncio.TimeoutError from None
        raise
    finally:
        timer.cancel()


async def _decode_exchange(call: Any, request: pb.DecodeRequest) -> pb.DecodeResponse:
    await call.write(request)
    reply = await call.read()
    if reply is grpc.aio.EOF:
        status = await call.code()
        if status is not None and status is not grpc.StatusCode.OK:
            details = await call.details()
            raise grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
        raise unavailable("decode stream closed by the node")
    if reply.refused:  # a node answers a failed step in the stream, which stays open
        raise refused_in_stream(reply)
    return reply


def refused_in_stream(reply: pb.DecodeResponse) -> RefusedInStream:
    """The error a step answered with `refused` raises (the status it names, UNKNOWN for a name it is not)."""
    code = getattr(grpc.StatusCode, reply.refused, grpc.StatusCode.UNKNOWN)
    return RefusedInStream(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=reply.error)
