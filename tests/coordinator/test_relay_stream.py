"""RelayStream, both ends over a real gRPC server on loopback: many chains on one stream matched by
request id, a refusal that leaves the stream open, a broken stream failing every waiter and reopening,
and bounds on what one stream may ask of a node."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from layerswarm.wire import relay_stream
from layerswarm.wire.relay_stream import RelayLink, serve_relay_stream
from layerswarm.wire.v1 import block_pb2 as pb

METHOD = "/layerswarm.test.Relay/RelayStream"


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


async def events_of(request: pb.RelayRequest) -> AsyncIterator[pb.RelayEvent]:
    """A stand-in hop: request ids say what to do ("refuse-", "hang-", "slow-", "late-"...); others answer at once."""
    rid = request.forward.request_id
    if rid.startswith("refuse"):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{rid} is not acceptable")
    if rid.startswith("hang"):
        await asyncio.sleep(3600)
    if rid.startswith("slow"):
        await asyncio.sleep(0.3)
    if rid.startswith("boom"):
        raise RuntimeError("a bug in the hop")
    if rid.startswith("flood"):  # a peer breaking the protocol: many acknowledgements, two finals
        for _ in range(5):
            yield pb.RelayEvent(request_id=rid, ack=True, trace=[pb.HopTrace(block=7)])
        yield pb.RelayEvent(request_id=rid, trace=[pb.HopTrace(block=7)])
    yield pb.RelayEvent(request_id=rid, ack=True, trace=[pb.HopTrace(block=request.index)])
    if rid.startswith("late"):  # the rest of the chain takes a while after this hop's acknowledgement
        await asyncio.sleep(0.3)
    yield pb.RelayEvent(request_id=rid, trace=[pb.HopTrace(block=request.index), pb.HopTrace(block=9)])


Handler = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[pb.RelayEvent]]


class Server:
    """A gRPC server on loopback whose RelayStream is `handler` (default: serve_relay_stream over
    `events_of`); `handler=None` registers no RelayStream at all, as an older node."""

    def __init__(self, handler: Handler | str | None = "serve") -> None:
        self.streams = 0
        self.closing = asyncio.Event()
        self.handler = self._serve if handler == "serve" else handler

    async def _serve(self, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RelayEvent]:
        self.streams += 1
        async for event in serve_relay_stream(
            requests, context, events_of, (Refused,), max_deadline_s=60.0, closing=self.closing
        ):
            yield event

    async def __aenter__(self) -> Server:
        self.server = grpc.aio.server()
        if callable(self.handler):
            rpc = grpc.stream_stream_rpc_method_handler(
                self.handler,
                request_deserializer=pb.RelayRequest.FromString,
                response_serializer=pb.RelayEvent.SerializeToString,
            )
            self.server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("layerswarm.test.Relay", {"RelayStream": rpc}),)
            )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(0)


def link_to(port: int) -> tuple[RelayLink, grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    method = channel.stream_stream(
        METHOD, request_serializer=pb.RelayRequest.SerializeToString, response_deserializer=pb.RelayEvent.FromString
    )
    return RelayLink(f"127.0.0.1:{port}", method), channel


@pytest.fixture
async def served() -> AsyncIterator[tuple[Server, RelayLink]]:
    """A server on loopback and a link to it, both closed after the test."""
    async with Server() as server:
        link, channel = link_to(server.port)
        try:
            yield server, link
        finally:
            await link.close()
            await channel.close()


def request(rid: str, index: int = 0, deadline_s: float = 5.0) -> pb.RelayRequest:
    return pb.RelayRequest(forward=pb.ForwardRequest(request_id=rid), index=index, deadline_s=deadline_s)


async def test_many_chains_share_one_stream_and_each_gets_its_own_events(served: tuple[Server, RelayLink]) -> None:
    server, link = served
    # A slow request first: the quick ones' events overtake it, and each still reads its own.
    calls = [await link.send(request(rid, index=i)) for i, rid in enumerate(["slow-0", "a", "b", "c"])]
    for i, call in enumerate(calls):
        ack, final = await call.read(), await call.read()
        assert ack.ack and [t.block for t in ack.trace] == [i]
        assert not final.ack and [t.block for t in final.trace] == [i, 9]
    assert server.streams == 1 and link.opened == 1


async def test_a_refusal_answers_its_request_and_the_stream_stays_open(served: tuple[Server, RelayLink]) -> None:
    server, link = served
    refused = await link.send(request("refuse-1"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await refused.read()
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "refuse-1 is not acceptable" in (caught.value.details() or "")
    ok = await link.send(request("after"))
    assert (await ok.read()).ack
    assert server.streams == 1


async def test_a_request_id_already_in_flight_on_the_stream_is_refused(served: tuple[Server, RelayLink]) -> None:
    _, link = served
    await link.send(request("hang-1"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await link.send(request("hang-1"))  # the sender's own check
    assert caught.value.code() is grpc.StatusCode.ALREADY_EXISTS


async def test_a_request_past_its_deadline_is_refused_with_deadline_exceeded(
    served: tuple[Server, RelayLink], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_stream, "LATE_GRACE_S", 0.0)
    _, link = served
    call = await link.send(request("hang-2", deadline_s=0.2))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(call.read(), 5.0)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_a_draining_node_finishes_the_chains_in_flight_then_ends_the_stream(
    served: tuple[Server, RelayLink],
) -> None:
    server, link = served
    late = await link.send(request("late-1"))
    assert (await asyncio.wait_for(late.read(), 5.0)).ack
    server.closing.set()  # the node got SIGTERM with a chain in flight
    refused = await link.send(request("new"))
    assert not (await asyncio.wait_for(late.read(), 5.0)).ack  # the chain in flight still ends
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(refused.read(), 5.0)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE and "shutting down" in (caught.value.details() or "")
    assert link._stream is not None
    await asyncio.wait_for(link._stream.reader, 5.0)  # then the node ends the stream itself
    assert link._stream.broken is not None and link._stream.broken.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_stream_past_its_in_flight_cap_refuses_the_next_chain_until_one_ends(
    served: tuple[Server, RelayLink], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_stream, "MAX_STREAM_IN_FLIGHT", 2)
    monkeypatch.setattr(relay_stream, "LATE_GRACE_S", 0.0)
    server, link = served
    held = [await link.send(request(f"hang-{i}", deadline_s=0.5)) for i in range(2)]
    over = await link.send(request("over"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(over.read(), 5.0)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in held:  # their deadlines end them, which frees the stream's slots
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(call.read(), 5.0)
    later = await link.send(request("later"))
    assert (await asyncio.wait_for(later.read(), 5.0)).ack
    assert server.streams == 1


async def test_a_sender_that_never_reads_its_events_stops_being_read_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's memory for one stream is bounded: once its outgoing events are full, it stops taking
    requests (HTTP/2 flow control then holds the sender), rather than running every request it is sent."""
    monkeypatch.setattr(relay_stream, "MAX_STREAM_IN_FLIGHT", 4)
    taken = 0

    async def endless() -> AsyncIterator[pb.RelayRequest]:
        nonlocal taken
        for i in range(10_000):
            taken += 1
            yield request(f"r{i}")

    class Context:  # the one call serve_relay_stream makes on its gRPC context
        async def send_initial_metadata(self, metadata: object) -> None:
            return None

    events = serve_relay_stream(endless(), Context(), events_of, (Refused,), max_deadline_s=60.0)  # type: ignore[arg-type]
    first = await events.__anext__()  # the sender reads one event, then never again
    await asyncio.sleep(0.3)
    assert first.request_id.startswith("r")
    # At most: the outgoing queue (2 x cap) of events, the cap's requests blocked on it, a few in hand.
    assert taken <= 3 * 4 + 4
    await events.aclose()


async def test_a_broken_stream_fails_every_waiting_request_and_the_next_send_reopens() -> None:
    async with Server() as first:
        link, channel = link_to(first.port)
        waiting = [await link.send(request(f"hang-{i}")) for i in range(3)]
        await first.server.stop(0)  # the next node dies with three chains in flight
        for call in waiting:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(call.read(), 5.0)
            assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        await channel.close()
    async with Server() as second:  # the link reopens on its next send (here to a new server)
        link._open_call = link_to(second.port)[0]._open_call
        call = await link.send(request("again"))
        assert (await asyncio.wait_for(call.read(), 5.0)).ack
        assert link.opened == 2
        await link.close()


async def test_a_node_without_relay_stream_answers_unimplemented() -> None:
    """What an older node answers: the sender (node/peers.py) then uses a Relay call per chain."""
    async with Server(handler=None) as server:
        link, channel = link_to(server.port)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(link.send(request("x")), 5.0)  # refused at open: before any write
            assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
        finally:
            await link.close()
            await channel.close()


async def test_a_stream_refused_at_open_reports_the_refusal_not_a_failed_write() -> None:
    """The refusal (here UNAUTHENTICATED, which carries the node's challenge) is what the sender must see,
    however the race between its first write and the server's refusal goes."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RelayEvent]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not signed")
        yield pb.RelayEvent()  # pragma: no cover - abort raises

    async with Server(refuse) as server:
        link, channel = link_to(server.port)
        try:
            for i in range(5):  # each send opens a new stream: the last one broke
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await (await link.send(request(f"r{i}"))).read()
                assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        finally:
            await link.close()
            await channel.close()


async def test_a_stream_answered_without_acceptance_or_status_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that answers the stream's headers without accepting it, then says nothing: the sender gives
    up on that stream and opens a new one for the next chain instead of writing chains into it."""
    monkeypatch.setattr(relay_stream, "STATUS_WAIT_S", 0.2)
    opened = 0

    async def mute(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RelayEvent]:
        nonlocal opened
        opened += 1
        await context.send_initial_metadata((("x-other", "1"),))
        await asyncio.sleep(30)
        yield pb.RelayEvent()  # pragma: no cover - the sender cancels first

    async with Server(mute) as server:
        link, channel = link_to(server.port)
        try:
            for expected in (1, 2):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await asyncio.wait_for(link.send(request(f"m{expected}")), 5.0)
                assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
                assert "without a status" in (caught.value.details() or "")
                assert link.opened == expected
            await asyncio.sleep(0.1)
            assert opened == 2
        finally:
            await link.close()
            await channel.close()


async def test_a_peer_gets_one_acknowledgement_and_one_final_event_through_per_request(
    served: tuple[Server, RelayLink],
) -> None:
    _, link = served
    call = await link.send(request("flood-1"))
    ack, final = await call.read(), await call.read()
    assert ack.ack and not final.ack and [t.block for t in final.trace] == [7]  # extra acks dropped
    after = await link.send(request("after"))
    assert (await after.read()).ack and not (await after.read()).ack
    await asyncio.sleep(0.1)  # the flood's extra events arrive and are dropped
    assert call._queue.empty() and link._stream is not None and not link._stream.waiting


async def test_a_bug_in_a_hop_answers_internal_and_a_given_up_request_leaves_nothing_behind(
    served: tuple[Server, RelayLink],
) -> None:
    _, link = served
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await (await link.send(request("boom-1"))).read()
    assert caught.value.code() is grpc.StatusCode.INTERNAL
    hanging = await link.send(request("hang-3"))
    hanging.cancel()  # the sender gave up on it
    assert link._stream is not None and not link._stream.waiting
