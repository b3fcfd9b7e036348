"""Strangers on a node's gRPC port: what a peer without the swarm token can cost it, bounded in count and
time, on 127.0.0.1 (node/guard.py, docs/trust.md "Bounded cost of strangers"). Each test fails with its
defence removed: the refusal before the message is read, the limits per peer and in all (every method,
ones added later included), members' calls apart from strangers', and memory given back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from layerswarm.bench.grpc_flood import run as flood_run
from layerswarm.coordinator import Coordinator, CoordinatorSettings
from layerswarm.node.guard import CallLimits, Slots
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire.security import SecuritySettings

from ..swarm import states, wait_until

TOKEN = SecuritySettings(token="guard-test-token")


def test_a_tokenless_flood_leaves_the_node_its_memory_and_fails_no_legit_call() -> None:
    """The issue's flood, shorter: 4 connections of max-size unary Forward calls, held ForwardStreams and
    padded health checks for 6 s against a node with a token, while a signed client keeps calling. Before
    node/guard.py (each refused message read whole, no limits) 8 connections grew the node from 272 to
    1,338 MiB and it stayed at 1,183 MiB; the bound here is the issue's (+64 MiB during, +16 after)."""
    report = flood_run(connections=4, seconds=6.0, alone_s=2.0, settle_s=3.0)
    outcomes = report["flood"]["outcomes"]
    assert outcomes.get("UNAUTHENTICATED", 0) > 100 and "OK" not in outcomes, outcomes  # the flood did run
    assert report["legit_failed_under_flood"] == 0, report["legit_under_flood"]
    assert report["node_rss_growth_peak_mib"] <= 64, report
    assert report["node_rss_growth_after_mib"] <= 16, report


def test_strangers_limits_per_address_in_all_and_in_rate() -> None:
    now = [0.0]
    slots = Slots(CallLimits(strangers=3, stranger_per_peer=2, stranger_rate=2.0, per_peer=2), clock=lambda: now[0])
    with slots.take("a", True) as one, slots.take("a", True) as two, slots.take("a", True) as three:
        assert (one, two, three) == (True, True, False)  # two at once from one address
        with slots.take("b", True) as four, slots.take("c", True) as five:
            assert (four, five) == (True, False)  # three at once from all
        with slots.take("a", False) as member, slots.take("a", False) as member2, slots.take("a", False) as m3:
            assert (member, member2, m3) == (True, True, False)  # members have their own count
    taken = []
    for _ in range(6):  # in rate: bursts of twice the rate, then the rate
        with slots.take("d", True) as ok:
            taken.append(ok)
    assert taken == [True, True, True, True, False, False]
    now[0] += 1.0
    with slots.take("d", True) as ok:
        assert ok


class Slow:
    """A method the node never had: the guard's limits must cover it too (the generation work adds some)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def call(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await self.release.wait()
        return request


@pytest.fixture
async def node_with_extra_method(model_dir: Path) -> AsyncIterator[tuple[Node, Slow]]:
    node = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.1, max_calls_per_peer=2))
    slow = Slow()
    handler = grpc.unary_unary_rpc_method_handler(slow.call)
    node.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Later", {"Slow": handler}),))
    await node.start()
    yield node, slow
    slow.release.set()
    await node.stop()


async def test_a_method_added_later_is_limited_per_peer_before_its_message_is_read(
    node_with_extra_method: tuple[Node, Slow],
) -> None:
    """Two calls at once per address: a third, on another connection from the same address (one
    connection would only queue it: HTTP/2 streams per connection are limited alike), is refused."""
    node, slow = node_with_extra_method
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection each
    target = f"127.0.0.1:{node.port}"
    async with grpc.aio.insecure_channel(target) as channel, grpc.aio.insecure_channel(target, options) as other:
        call = channel.unary_unary("/test.Later/Slow")
        held = [asyncio.ensure_future(call(b"x", timeout=10)) for _ in range(2)]
        await wait_until(lambda: sum(node.guard.slots.members.values()) == 2, what="two calls held")
        with pytest.raises(grpc.aio.AioRpcError) as third:
            await other.unary_unary("/test.Later/Slow")(b"y", timeout=10)
        assert third.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many calls at once" in (third.value.details() or "")
        slow.release.set()
        assert await asyncio.gather(*held) == [b"x", b"x"]


async def test_signed_health_checks_are_not_starved_by_strangers_from_the_same_address(model_dir: Path) -> None:
    """Strangers' health checks from 127.0.0.1 fill their tiny budget; the coordinator, on the same
    address, signs its checks once the node has proved itself, so the node stays healthy throughout."""
    settings = NodeSettings(
        model_dir=model_dir,
        block=0,
        advertise=False,
        grace_s=0.1,
        security=TOKEN,
        max_stranger_calls_per_peer=1,
        stranger_rate=1.0,
    )
    node = Node(settings)
    await node.start()
    address = f"127.0.0.1:{node.port}"
    coord = Coordinator(
        CoordinatorSettings(model_dir=model_dir, peers=(address,), mdns=False, security=TOKEN, health_interval_s=0.1)
    )
    await coord.start()
    refused: list[Any] = []
    try:
        await wait_until(lambda: states(coord).get(address) == "healthy", what="healthy")
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(40):
                try:
                    await health.Check(health_pb2.HealthCheckRequest(service="x" * 100_000), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    refused.append(exc.code())
                assert states(coord).get(address) == "healthy"
                await asyncio.sleep(0.025)
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in refused  # the strangers' budget was spent
    finally:
        await coord.stop()
        await node.stop()
