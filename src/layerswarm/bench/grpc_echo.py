"""A bare gRPC echo of raw bytes, and a ladder of rungs between it and a real node: each rung adds one
part of a node's hop, so the difference between two rungs is that part's cost.

The server runs in another process (as a node does), on grpc.aio like a node. Rungs, all reused streams:

- `raw`: identity (de)serializers: the gRPC stack's own cost, nothing of ours.
- `proto`: a ForwardRequest in, a ForwardResponse with the same tensor out (protobuf both ways).
- `codec`: + what a node does to the tensor besides computing: decode with its checks, the input range
  check, the output check and the fp32 -> wire-dtype encode of the reply.
- `thread`: + the hand-off of an (identity) compute to a one-thread pool and back, as a node computes.

Set beside the raw TCP floor (tcp_floor.py) and a real node's hop (round trip minus its compute) in the
same run, it splits a hop's overhead into the wire's, gRPC's and each of ours.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import torch

from layerswarm.wire import codec
from layerswarm.wire.memory import keep_large_buffers
from layerswarm.wire.v1 import block_pb2 as pb

SERVICE = "layerswarm.bench.Echo"
RUNGS = ("raw", "proto", "codec", "thread")
# What each step up the ladder adds, the last being a real node over the `thread` rung.
HOP_PARTS = ("protobuf", "codec_and_checks", "thread_hand_off", "node_rest")
OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.max_send_message_length", 64 * 1024 * 1024)]


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def _stream(answer: Callable[[Any], Any]) -> Callable[..., AsyncIterator[Any]]:
    async def handler(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            yield await answer(request)

    return handler


async def _raw(request: bytes) -> bytes:
    return request


async def _proto(request: pb.ForwardRequest) -> pb.ForwardResponse:
    return pb.ForwardResponse(request_id=request.request_id, activations=request.activations)


def _checked(request: pb.ForwardRequest) -> tuple[torch.Tensor, torch.dtype]:
    x = codec.decode(request.activations)  # with its finiteness check, as a node decodes
    wire = codec.torch_dtype(request.activations.dtype)
    if codec.peak_abs(x) > codec.value_limit(wire):  # the node's input range check
        raise ValueError("out of range")
    return x.to(torch.float32), wire  # a block computes in float32


def _reply(request: pb.ForwardRequest, out: torch.Tensor, wire: torch.dtype) -> pb.ForwardResponse:
    if codec.peak_abs(out) > codec.value_limit(wire):  # the node's output check
        raise ValueError("out of range")
    return pb.ForwardResponse(request_id=request.request_id, activations=codec.encode(out, wire))


async def _codec(request: pb.ForwardRequest) -> pb.ForwardResponse:
    x, wire = _checked(request)
    return _reply(request, x, wire)


def _in_thread(pool: ThreadPoolExecutor) -> Callable[[pb.ForwardRequest], Any]:
    async def answer(request: pb.ForwardRequest) -> pb.ForwardResponse:
        x, wire = _checked(request)
        out = await asyncio.get_running_loop().run_in_executor(pool, torch.clone, x)
        return _reply(request, out, wire)

    return answer


def _handlers(pool: ThreadPoolExecutor) -> dict[str, grpc.RpcMethodHandler]:
    proto = {
        "request_deserializer": pb.ForwardRequest.FromString,
        "response_serializer": pb.ForwardResponse.SerializeToString,
    }
    return {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "raw": grpc.stream_stream_rpc_method_handler(_stream(_raw)),
        "proto": grpc.stream_stream_rpc_method_handler(_stream(_proto), **proto),
        "codec": grpc.stream_stream_rpc_method_handler(_stream(_codec), **proto),
        "thread": grpc.stream_stream_rpc_method_handler(_stream(_in_thread(pool)), **proto),
    }


async def _serve(conn: Any) -> None:
    torch.set_num_threads(1)  # as a node computes, with its allocator settings
    keep_large_buffers()
    server = grpc.aio.server(options=OPTIONS)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="echo-compute")  # as a node's compute thread
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, _handlers(pool)),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    await server.wait_for_termination()


def _echo_process(conn: Any) -> None:
    asyncio.run(_serve(conn))


class GrpcEcho:
    """The echo server in a spawned process; a channel with its unary method and one reused stream per rung."""

    async def __aenter__(self) -> GrpcEcho:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_echo_process, args=(child,), daemon=True)
        self._proc.start()
        port = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
        self._unary = self._channel.unary_unary(f"/{SERVICE}/Unary")
        self._streams = {"raw": self._channel.stream_stream(f"/{SERVICE}/raw")()}
        for rung in RUNGS[1:]:
            method = self._channel.stream_stream(
                f"/{SERVICE}/{rung}",
                request_serializer=pb.ForwardRequest.SerializeToString,
                response_deserializer=pb.ForwardResponse.FromString,
            )
            self._streams[rung] = method()
        return self

    async def round_trip(self, payload: bytes, transport: str) -> float:
        """Seconds for `payload` to go to the echo server and back, by a unary call or the reused raw stream."""
        started = time.perf_counter()
        if transport == "unary":
            reply = await self._unary(payload)
        else:
            await self._streams["raw"].write(payload)
            reply = await self._streams["raw"].read()
        elapsed = time.perf_counter() - started
        if len(reply) != len(payload):
            raise RuntimeError(f"echo returned {len(reply)} bytes for {len(payload)}")
        return elapsed

    async def rung_trip(self, rung: str, request: pb.ForwardRequest) -> tuple[float, pb.ForwardResponse]:
        """Seconds for a ForwardRequest to go through one protobuf rung and back, and its reply."""
        stream = self._streams[rung]
        started = time.perf_counter()
        await stream.write(request)
        reply = await stream.read()
        elapsed = time.perf_counter() - started
        if len(reply.activations.data) != len(request.activations.data):
            raise RuntimeError(f"rung {rung} returned {len(reply.activations.data)} bytes")
        return elapsed, reply

    async def __aexit__(self, *exc: object) -> None:
        for stream in self._streams.values():
            stream.cancel()
        await self._channel.close()
        self._proc.terminate()
        self._proc.join(5)
