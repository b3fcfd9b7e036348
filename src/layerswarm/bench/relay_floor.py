"""What a relay chain could save on messages alone, before anyone builds one for decoder streams.

A star token is H round trips from the coordinator (2H messages); a chain is one message to the first
node, H - 1 from node to node and one back (H + 1). Here H bare gRPC processes (grpc.aio, raw bytes: no
protobuf, no checks, no compute) carry one token's activation both ways, interleaved:

    star   the client writes to each process's reused stream in turn and reads its echo
    chain  the client writes to the first process's Chain stream; each process forwards to the next over
           its own reused stream, and the last hands the bytes to the client over a Collect stream the
           client holds open

Each process stamps the bytes, its index on a star trip and CHAIN_STAMP + its index on a chain trip, and
the client checks that each way went 0, 1, ..., H - 1 by its own method (a chain trip that was really a
star, or skipped a process, fails the run).
`saved_ms` is what a chain could take off a token here if nothing else in a hop changed: the most a
decoder relay chain could buy on messaging (it would add a node's own checks per forward, and remove
the coordinator's per-hop work, neither of which is in this figure).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

SERVICE = "layerswarm.bench.RelayFloor"
OPTIONS = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)]
WARMUP = 30
START_TIMEOUT_S = 60.0  # a process that has not answered by then failed to start (spawn imports grpc)
TRIP_TIMEOUT_S = 10.0  # a trip this late means a process died or stalled mid-run: the run fails, never hangs
CHAIN_STAMP = 100  # a chain hop stamps CHAIN_STAMP + its index, a star hop its index


def _handlers(index: int, next_port: int | None) -> dict[str, grpc.RpcMethodHandler]:
    collected: asyncio.Queue[bytes] = asyncio.Queue()
    onward: dict[str, Any] = {}

    async def star(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request + bytes([index])

    async def chain(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for request in requests:
            out = request + bytes([CHAIN_STAMP + index])
            if next_port is None:
                collected.put_nowait(out)
                continue
            if "call" not in onward:  # one reused stream to the next process, as a node's PeerPool keeps
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{next_port}", options=OPTIONS)
                onward["channel"], onward["call"] = channel, channel.stream_stream(f"/{SERVICE}/Chain")()
            await onward["call"].write(out)
        yield b""

    async def collect(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        while True:
            yield await collected.get()

    return {
        "Star": grpc.stream_stream_rpc_method_handler(star),
        "Chain": grpc.stream_stream_rpc_method_handler(chain),
        "Collect": grpc.unary_stream_rpc_method_handler(collect),
    }


async def _serve(conn: Any, index: int) -> None:
    server = grpc.aio.server(options=OPTIONS)
    port = server.add_insecure_port("127.0.0.1:0")
    conn.send(port)
    next_port = conn.recv()  # None for the last process
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, _handlers(index, next_port)),))
    await server.start()
    conn.send("ready")
    await server.wait_for_termination()


def _process(conn: Any, index: int) -> None:
    asyncio.run(_serve(conn, index))


class _Swarm:
    """H spawned processes, a reused Star stream to each, a Chain stream to the first, Collect from the last."""

    def __init__(self, hops: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes, self.procs = [], []
        self.channels: list[grpc.aio.Channel] = []
        self.calls: list[Any] = []  # every call opened, for close()
        for i in range(hops):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_process, args=(child, i), daemon=True)
            proc.start()
            child.close()  # ours: with it closed, a child that dies shows as EOF on the pipe at once
            self.pipes.append(parent)
            self.procs.append(proc)

    async def open(self) -> None:
        ports = [await self._answer(i) for i in range(len(self.pipes))]
        for pipe, next_port in zip(self.pipes, [*ports[1:], None], strict=True):
            pipe.send(next_port)
        for i in range(len(self.pipes)):
            await self._answer(i)  # serving
        self.channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=OPTIONS) for p in ports]
        self.stars = [c.stream_stream(f"/{SERVICE}/Star")() for c in self.channels]
        self.chain = self.channels[0].stream_stream(f"/{SERVICE}/Chain")()
        self.collect = self.channels[-1].unary_stream(f"/{SERVICE}/Collect")(b"")
        self.calls = [*self.stars, self.chain, self.collect]

    async def _answer(self, i: int) -> Any:
        """Process i's next word over its pipe; a process that died or hangs fails the run, never blocks it."""
        pipe = self.pipes[i]
        if not await asyncio.get_running_loop().run_in_executor(None, pipe.poll, START_TIMEOUT_S):
            raise RuntimeError(f"relay-floor process {i} did not start within {START_TIMEOUT_S:g} s")
        try:
            return pipe.recv()
        except EOFError:
            self.procs[i].join(5)
            raise RuntimeError(
                f"relay-floor process {i} exited with {self.procs[i].exitcode} before it served"
            ) from None

    async def star_trip(self, payload: bytes) -> bytes:
        for stream in self.stars:
            await stream.write(payload)
            payload = _bytes(await stream.read())
        return payload

    async def chain_trip(self, payload: bytes) -> bytes:
        await self.chain.write(payload)
        return _bytes(await self.collect.read())

    async def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for channel in self.channels:
            await channel.close()
        for proc in self.procs:
            proc.terminate()
            proc.join(5)
        for pipe in self.pipes:
            pipe.close()  # ours, closed here rather than by the garbage collector in some later test


async def star_and_chain_ms(hops: int, payload: bytes, trips: int) -> dict[str, float]:
    """Median ms of a token's trip through `hops` bare processes, star-wise and chain-wise, interleaved
    (which goes first alternates, so a busy machine slows both alike)."""
    swarm = _Swarm(hops)
    try:
        await swarm.open()
        routes = {"star": bytes(range(hops)), "chain": bytes(CHAIN_STAMP + i for i in range(hops))}
        ways = {"star": swarm.star_trip, "chain": swarm.chain_trip}
        times: dict[str, list[float]] = {"star": [], "chain": []}
        for n in range(WARMUP + trips):
            for name in ("star", "chain") if n % 2 else ("chain", "star"):
                started = time.perf_counter()
                try:
                    reply = await asyncio.wait_for(ways[name](payload), TRIP_TIMEOUT_S)
                except asyncio.TimeoutError:
                    dead = [i for i, p in enumerate(swarm.procs) if not p.is_alive()]
                    raise RuntimeError(
                        f"{name}: no reply within {TRIP_TIMEOUT_S:g} s (processes gone: {dead})"
                    ) from None
                elapsed = time.perf_counter() - started
                if reply != payload + routes[name]:
                    went = list(reply[len(payload) :])
                    raise RuntimeError(f"{name}: the bytes came back by {went}, not {list(routes[name])}")
                if n >= WARMUP:
                    times[name].append(elapsed)
    finally:
        await swarm.close()
    star, chain = statistics.median(times["star"]) * 1e3, statistics.median(times["chain"]) * 1e3
    return {"hops": hops, "star_ms": round(star, 3), "chain_ms": round(chain, 3), "saved_ms": round(star - chain, 3)}


def _bytes(reply: Any) -> bytes:
    """A stream's reply, or the run's failure where the stream ended instead (grpc.aio.EOF)."""
    if not isinstance(reply, bytes):
        raise RuntimeError("a relay-floor stream ended mid-run")
    return reply
