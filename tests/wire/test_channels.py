"""A channel that kept calling a node through an outage reaches it soon after it is back: the peer
channel options cap gRPC's reconnect backoff, which otherwise grows for as long as the node is away."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from layerswarm.wire.channels import PEER_CHANNEL_OPTIONS

OUTAGE_S = 6.0  # gRPC's default backoff then has its next attempt 2-4 s after the node is back


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def _check(channel: grpc.aio.Channel) -> None:
    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.2)


async def _back_after_an_outage(options: list[tuple[str, Any]]) -> float:
    """Seconds from a node's return until a channel that called it all through its outage gets through."""
    address = _free_address()
    channel = grpc.aio.insecure_channel(address, options=options)
    server = grpc.aio.server()
    try:
        down_since = time.perf_counter()
        while time.perf_counter() - down_since < OUTAGE_S:  # a client's calls while the node is away
            try:
                await _check(channel)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            await asyncio.sleep(0.1)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(address)
        await server.start()
        back = time.perf_counter()
        while True:
            try:
                await _check(channel)
                return time.perf_counter() - back
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.02)
    finally:
        await channel.close()
        await server.stop(None)


def test_a_node_back_from_an_outage_is_reached_within_about_a_second() -> None:
    seconds = asyncio.run(_back_after_an_outage(PEER_CHANNEL_OPTIONS))
    assert seconds < 1.5, f"the channel reached the node {seconds:.2f} s after it was back"


def test_grpcs_default_backoff_keeps_refusing_for_seconds() -> None:
    """What the cap prevents, on this grpcio: without it the same channel waits out a grown backoff (if
    this starts failing, grpcio changed its backoff and the cap may be moot)."""
    default = [o for o in PEER_CHANNEL_OPTIONS if "backoff" not in o[0]]
    assert asyncio.run(_back_after_an_outage(default)) > 1.5
