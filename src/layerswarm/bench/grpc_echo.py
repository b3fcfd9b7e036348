"""A bare gRPC echo of raw bytes: the gRPC stack's own cost of a hop, with nothing of ours in it.

The server runs in another process (as a node does), on grpc.aio like a node, with identity
(de)serializers: no protobuf, no tensors, no thread hand-off. Set beside the raw TCP floor
(tcp_floor.py) and a real node's hop in the same run, it splits a hop's overhead into the wire's,
gRPC's and ours.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

UNARY = "/layerswarm.bench.Echo/Unary"
STREAM = "/layerswarm.bench.Echo/Stream"
OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.max_send_message_length", 64 * 1024 * 1024)]


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def _stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


async def _serve(conn: Any) -> None:
    server = grpc.aio.server(options=OPTIONS)
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("layerswarm.bench.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    await server.wait_for_termination()


def _echo_process(conn: Any) -> None:
    asyncio.run(_serve(conn))


class GrpcEcho:
    """The echo server in a spawned process, and a channel with a unary method and a reused stream."""

    async def __aenter__(self) -> GrpcEcho:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_echo_process, args=(child,), daemon=True)
        self._proc.start()
        port = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
        self._unary = self._channel.unary_unary(UNARY)
        self._stream = self._channel.stream_stream(STREAM)()
        return self

    async def round_trip(self, payload: bytes, transport: str) -> float:
        """Seconds for `payload` to go to the echo server and back, by a unary call or the reused stream."""
        started = time.perf_counter()
        if transport == "unary":
            reply = await self._unary(payload)
        else:
            await self._stream.write(payload)
            reply = await self._stream.read()
        elapsed = time.perf_counter() - started
        if len(reply) != len(payload):
            raise RuntimeError(f"echo returned {len(reply)} bytes for {len(payload)}")
        return elapsed

    async def __aexit__(self, *exc: object) -> None:
        self._stream.cancel()
        await self._channel.close()
        self._proc.terminate()
        self._proc.join(5)
