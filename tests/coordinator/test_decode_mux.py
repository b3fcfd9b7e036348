"""The coordinator's DecodeMux (membership/decode_mux.py) against a real decoder node on loopback: the steps
of a turn go as one DecodeBatch and each gets its own reply, what a stream's own DecodeStream gets; a
refused step is that step's RefusedInStream; a timeout cancels the shared call and every waiting step gets
asyncio.TimeoutError, the next step opening a call on which the node no longer knows the old streams;
groups of streams sent apart are answered together (their next steps share a message); a node without
DecodeBatchStream gets a DecodeStream per stream; a client that closes fails what waits, and every later
step at once (as does a step whose call cannot be opened); a message behind a slow one is not given up
before it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from layerswarm.coordinator.membership.clients import ClientPool, NodeClient
from layerswarm.coordinator.membership.decode_links import DecodeLink, RefusedInStream
from layerswarm.coordinator.membership.decode_mux import DecodeMux, MuxLink
from layerswarm.node.server import Node
from layerswarm.node.service import BlockService
from layerswarm.node.settings import NodeSettings
from layerswarm.wire.v1 import block_pb2 as pb

from ..lm_nodes import TOL, decode_request, make_lm_dir, out_of

D = 32
LOST = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mux") / "lm"
    make_lm_dir(path)
    return path


@pytest.fixture
async def decoder(lm_dir: Path) -> AsyncIterator[tuple[Node, ClientPool, str]]:
    node = Node(NodeSettings(model_dir=lm_dir, block=0, advertise=False, grace_s=0.1))
    await node.start()
    pool = ClientPool()
    try:
        yield node, pool, f"127.0.0.1:{node.port}"
    finally:
        await pool.close()
        await node.stop()


def mux_of(client: NodeClient) -> DecodeMux:
    link = client.decode_link()
    assert isinstance(link, MuxLink)
    return link.mux


def x_(t: int = 1) -> torch.Tensor:
    return torch.randn(1, t, D)


async def test_the_steps_of_one_turn_go_as_one_message_and_get_what_their_own_calls_get(
    decoder: tuple[Node, ClientPool, str],
) -> None:
    _node, pool, address = decoder
    client = pool.get(address)
    links = [client.decode_link() for _ in range(6)]
    mux = mux_of(client)
    own = [DecodeLink(client) for _ in links]  # today's way: a DecodeStream per stream
    prompts = [x_(n) for n in (2, 5, 1, 7, 3, 4)]
    replies = await asyncio.gather(
        *(link.step(decode_request(f"m{i}", 0, p), 5) for i, (link, p) in enumerate(zip(links, prompts, strict=True)))
    )
    assert [r.length for r in replies] == [2, 5, 1, 7, 3, 4] and [r.stream_id for r in replies] == [
        f"m{i}" for i in range(6)
    ]
    assert (mux.messages, mux.steps, mux.calls) == (1, 6, 1)  # prefills of different T: one message all the same
    for i, p in enumerate(prompts):
        await own[i].step(decode_request(f"o{i}", 0, p), 5)
    for start in range(3):
        xs = [x_() for _ in links]
        starts = [p.shape[1] + start for p in prompts]
        muxed = await asyncio.gather(
            *(
                link.step(decode_request(f"m{i}", starts[i], x), 5)
                for i, (link, x) in enumerate(zip(links, xs, strict=True))
            )
        )
        alone = [await own[i].step(decode_request(f"o{i}", starts[i], x), 5) for i, x in enumerate(xs)]
        for a, b in zip(muxed, alone, strict=True):  # one block call of 6 rows, or 6 of one: BLAS's last bits
            assert (out_of(a) - out_of(b)).abs().max().item() < TOL and a.length == b.length
        assert {r.batched for r in muxed} == {len(links)}  # one block call at the node
    assert (mux.messages, mux.steps, mux.calls) == (4, 24, 1)
    lone = await links[0].step(decode_request("m0", 5, x_()), 5)  # a lone step: a message of its own
    assert lone.length == 6 and mux.messages == 5
    for link in own:
        link.close()


async def test_a_refused_step_fails_alone_and_the_call_goes_on(decoder: tuple[Node, ClientPool, str]) -> None:
    _node, pool, address = decoder
    client = pool.get(address)
    a, b, c = (client.decode_link() for _ in range(3))
    await asyncio.gather(a.step(decode_request("a", 0, x_(3)), 5), b.step(decode_request("b", 0, x_(2)), 5))
    outcomes = await asyncio.gather(
        a.step(decode_request("a", 3, x_()), 5),
        b.step(decode_request("b", 9, x_()), 5),  # ahead of what it holds
        c.step(decode_request("nobody", 4, x_()), 5),
        return_exceptions=True,
    )
    assert isinstance(outcomes[0], pb.DecodeResponse) and outcomes[0].length == 4
    assert isinstance(outcomes[1], RefusedInStream) and outcomes[1].code() is grpc.StatusCode.FAILED_PRECONDITION
    assert isinstance(outcomes[2], RefusedInStream) and outcomes[2].code() is grpc.StatusCode.NOT_FOUND
    mux = mux_of(client)
    assert (mux.messages, mux.calls) == (2, 1)
    assert (await b.step(decode_request("b", 2, x_()), 5)).length == 3  # b's stream is as it was


async def test_a_timeout_cancels_the_shared_call_and_every_waiting_step_times_out(
    decoder: tuple[Node, ClientPool, str],
) -> None:
    node, pool, address = decoder
    service = node.decode
    assert service is not None
    go = asyncio.Event()
    real = service.decode

    async def stalled(request: pb.DecodeRequest, caller: object) -> pb.DecodeResponse:
        if request.start > 0:
            await go.wait()
        return await real(request, caller)  # type: ignore[arg-type]

    service.decode = stalled  # type: ignore[method-assign,assignment]
    client = pool.get(address)
    links = [client.decode_link() for _ in range(3)]
    await asyncio.gather(*(link.step(decode_request(f"t{i}", 0, x_(2)), 5) for i, link in enumerate(links)))
    assert len(service.table) == 3
    loop = asyncio.get_running_loop()
    started = loop.time()
    first = [
        asyncio.ensure_future(links[0].step(decode_request("t0", 2, x_()), 0.3)),
        asyncio.ensure_future(links[1].step(decode_request("t1", 2, x_()), 0.2)),
    ]
    for _ in range(3):
        await asyncio.sleep(0)
    late = asyncio.ensure_future(links[2].step(decode_request("t2", 2, x_()), 5))  # a later message, same call
    outcomes = await asyncio.gather(*first, late, return_exceptions=True)
    assert all(isinstance(o, asyncio.TimeoutError) for o in outcomes), outcomes
    assert loop.time() - started < 1.5
    assert mux_of(client).messages == 3
    go.set()
    # A new call; the node freed every stream the old one opened (or has not seen it end yet).
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await links[0].step(decode_request("t0", 2, x_()), 5)
    assert caught.value.code() in LOST
    assert mux_of(client).calls == 2
    for _ in range(50):
        if len(service.table) == 0:
            break
        await asyncio.sleep(0.05)
    assert len(service.table) == 0
    assert (await links[1].step(decode_request("t1", 0, x_(2)), 5)).length == 2  # a rebuild: start 0


async def test_streams_answered_apart_are_handed_their_replies_together(decoder: tuple[Node, ClientPool, str]) -> None:
    """Two groups of streams whose steps went in two messages: the first reply waits for the second, so
    that the groups' next steps share one message."""
    _node, pool, address = decoder
    client = pool.get(address)
    mux = mux_of(client)
    links = [client.decode_link() for _ in range(4)]
    await asyncio.gather(*(link.step(decode_request(f"h{i}", 0, x_(2)), 5) for i, link in enumerate(links)))

    async def walk(i: int, delay: int) -> list[int]:
        for _ in range(delay):
            await asyncio.sleep(0)  # a later event-loop turn: another message
        batched = []
        for start in range(2, 6):
            batched.append((await links[i].step(decode_request(f"h{i}", start, x_()), 5)).batched)
        return batched

    before = mux.messages
    batched = await asyncio.gather(walk(0, 0), walk(1, 0), walk(2, 3), walk(3, 3))
    # 2 messages for the first steps, then 1 a round (apart, the groups would send 2 a round: 8)
    assert mux.messages - before == 5, mux.messages - before
    assert mux.held >= 2
    assert all(b[1:] == [4, 4, 4] for b in batched), batched  # one block call of all four at the node


async def test_a_node_without_decode_batches_gets_a_decodestream_per_stream(
    lm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unimplemented(
        self: BlockService, requests: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeBatchReply]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield pb.DecodeBatchReply()

    monkeypatch.setattr(BlockService, "DecodeBatchStream", unimplemented)
    node = Node(NodeSettings(model_dir=lm_dir, block=0, advertise=False, grace_s=0.1))
    await node.start()
    pool = ClientPool()
    try:
        client = pool.get(f"127.0.0.1:{node.port}")
        links = [client.decode_link() for _ in range(3)]
        replies = await asyncio.gather(
            *(link.step(decode_request(f"u{i}", 0, x_(2)), 5) for i, link in enumerate(links))
        )
        assert [r.length for r in replies] == [2, 2, 2]
        mux = mux_of(client)
        assert not mux.supported
        replies = await asyncio.gather(
            *(link.step(decode_request(f"u{i}", 2, x_()), 5) for i, link in enumerate(links))
        )
        assert [r.length for r in replies] == [3, 3, 3]
        assert node.metrics.registry.get_sample_value("layerswarm_node_requests_total", {"rpc": "DecodeStream"}) == 6
        later = client.decode_link()  # a stream opened from now on goes straight to its own DecodeStream
        assert (await later.step(decode_request("v", 0, x_(2)), 5)).length == 2
        assert mux.messages == 1
        for link in [*links, later]:
            link.close()
    finally:
        await pool.close()
        await node.stop()


async def test_closing_the_client_fails_the_waiting_steps_as_unavailable(decoder: tuple[Node, ClientPool, str]) -> None:
    node, pool, address = decoder
    service = node.decode
    assert service is not None
    real = service.decode

    async def stalled(request: pb.DecodeRequest, caller: object) -> pb.DecodeResponse:
        await asyncio.sleep(10)
        return await real(request, caller)  # type: ignore[arg-type]

    service.decode = stalled  # type: ignore[method-assign,assignment]
    link = pool.get(address).decode_link()
    step = asyncio.ensure_future(link.step(decode_request("c", 0, x_(2)), 30))
    await asyncio.sleep(0.2)
    await pool.drop(address)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await step
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_link_that_outlived_its_client_fails_at_once_not_never(decoder: tuple[Node, ClientPool, str]) -> None:
    """The health monitor drops a node's client (it left, or restarted under a new boot) while streams still
    hold links to it: their next step is UNAVAILABLE at once (the stream moves on), never a step that
    waits for ever (the closed channel refuses the new call inside the flush, with no timer yet)."""
    _node, pool, address = decoder
    link = pool.get(address).decode_link()
    assert (await link.step(decode_request("g", 0, x_(2)), 5)).length == 2
    await pool.drop(address)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(link.step(decode_request("g", 2, x_()), 5), 2)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    fresh = pool.get(address).decode_link()  # the pool's new client: a new call, the node knows the stream not
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await fresh.step(decode_request("g", 2, x_()), 5)
    assert caught.value.code() in LOST


async def test_a_flush_that_cannot_open_a_call_fails_its_steps(decoder: tuple[Node, ClientPool, str]) -> None:
    _node, pool, address = decoder
    client = pool.get(address)
    link = client.decode_link()
    await client.channel.close()  # the channel gone under the mux, its client not told
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(link.step(decode_request("h", 0, x_(2)), 5), 2)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_steps_behind_a_slow_message_wait_for_it_and_the_call_is_kept(
    decoder: tuple[Node, ClientPool, str],
) -> None:
    """Replies come in order: a decode step sent behind a long step (a rebuild's replay) cannot be answered
    before it. Its message is given up no earlier than the one ahead of it, so a short timeout behind a
    long step does not drop the call (and every stream's cache on the node with it)."""
    node, pool, address = decoder
    service = node.decode
    assert service is not None
    real = service.decode

    async def slow(request: pb.DecodeRequest, caller: object) -> pb.DecodeResponse:
        if request.stream_id == "long":
            await asyncio.sleep(0.6)
        return await real(request, caller)  # type: ignore[arg-type]

    service.decode = slow  # type: ignore[method-assign,assignment]
    client = pool.get(address)
    long_link, short_link = client.decode_link(), client.decode_link()
    assert (await short_link.step(decode_request("short", 0, x_(2)), 5)).length == 2
    long_step = asyncio.ensure_future(long_link.step(decode_request("long", 0, x_(8)), 3))
    await asyncio.sleep(0.05)  # its message went
    short = await short_link.step(decode_request("short", 2, x_()), 0.2)  # a later message, same call
    assert short.length == 3 and (await long_step).length == 8
    assert mux_of(client).calls == 1
