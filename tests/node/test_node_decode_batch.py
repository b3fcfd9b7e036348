"""DecodeBatchStream at a decoder node over real gRPC on loopback: many streams' steps in one message get
what the same steps get one by one, a stream's steps in one message keep their order, the step limit and
ownership are enforced per message and per step, and the call's end frees its streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from layerswarm.models.lm.model import DecoderBlock, DecoderLM
from layerswarm.wire.discovery import MAX_DECODE_BATCH_STEPS
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from ..lm_nodes import TOL, LocalStream, decode_request, out_of, proxy_from, refusal
from ..swarm import wait_until
from .test_node_decode import block, lm, metric, serving, x_

__all__ = ["block", "lm"]  # module fixtures, shared with test_node_decode.py


def batch(steps: Iterable[pb.DecodeRequest]) -> pb.DecodeBatch:
    return pb.DecodeBatch(steps=list(steps))


class Batches:
    """One DecodeBatchStream call, a message at a time."""

    def __init__(self, stub: pb_grpc.BlockNodeStub, **kw: object) -> None:
        self.queue: asyncio.Queue[pb.DecodeBatch | None] = asyncio.Queue()
        self.call = stub.DecodeBatchStream(self._messages(), **kw)  # type: ignore[arg-type]

    async def _messages(self) -> AsyncIterator[pb.DecodeBatch]:
        while (item := await self.queue.get()) is not None:
            yield item

    async def send(self, steps: Iterable[pb.DecodeRequest]) -> list[pb.DecodeResponse]:
        await self.queue.put(batch(steps))
        reply = await self.call.read()
        assert reply is not grpc.aio.EOF, await self.call.details()
        return list(reply.replies)

    async def end(self) -> None:
        await self.queue.put(None)
        assert await self.call.read() is grpc.aio.EOF


async def test_a_batch_of_many_streams_steps_equals_the_same_steps_one_by_one(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    """The same prompts and steps as one DecodeBatch per round (streams b*): bit for bit (fp32) what the
    block computes for those steps as one call, each message's steps in one block call; and what one
    DecodeStream step at a time gets (streams a*), up to the last bits of a taller matrix product."""
    torch.manual_seed(7)
    lengths = [3, 9, 1, 5, 12]
    async with serving(lm[1]) as (node, stub):
        prompts = [x_(n) for n in lengths]
        rounds = [[x_(3 if r == 2 else 1) for _ in lengths] for r in range(4)]
        starts = [[n + (r if r < 3 else r + 2) for n in lengths] for r in range(4)]

        alone: list[list[torch.Tensor]] = []
        queue: asyncio.Queue[pb.DecodeRequest | None] = asyncio.Queue()

        async def one_by_one() -> AsyncIterator[pb.DecodeRequest]:
            while (item := await queue.get()) is not None:
                yield item

        call = stub.DecodeStream(one_by_one())
        for i, prompt in enumerate(prompts):
            await queue.put(decode_request(f"a{i}", 0, prompt))
            assert (await call.read()).length == lengths[i]
        for r, xs in enumerate(rounds):
            outs = []
            for i, x in enumerate(xs):
                await queue.put(decode_request(f"a{i}", starts[r][i], x))
                outs.append(out_of(await call.read()))
            alone.append(outs)
        await queue.put(None)

        service = node.decode
        assert service is not None
        engine = service.runtime.engine  # the reference: the node's own engine, in this process
        caches = [engine.new_cache() for _ in lengths]
        for prompt, cache in zip(prompts, caches, strict=True):  # prompts of different T: a call each
            engine.decode(prompt.numpy(), [cache])
        batches = Batches(stub)
        replies = await batches.send(decode_request(f"b{i}", 0, p) for i, p in enumerate(prompts))
        assert [r.length for r in replies] == lengths and not any(r.refused for r in replies)
        calls_before = metric(node, "layerswarm_node_decode_batch_size_count")
        batched: list[int] = []
        for r, xs in enumerate(rounds):
            replies = await batches.send(decode_request(f"b{i}", starts[r][i], x) for i, x in enumerate(xs))
            assert [reply.stream_id for reply in replies] == [f"b{i}" for i in range(len(lengths))]
            assert [reply.length for reply in replies] == [s + x.shape[1] for s, x in zip(starts[r], xs, strict=True)]
            together = engine.decode(np.concatenate([x.numpy() for x in xs]), caches)  # the batch as one call
            for i, reply in enumerate(replies):
                assert torch.equal(out_of(reply), torch.from_numpy(together[i : i + 1])), (r, i)
                # against the stream alone: the same up to BLAS's order of sums for 1 row or 5 (last bits)
                assert (out_of(reply) - alone[r][i]).abs().max().item() < TOL, (r, i)
            batched.append(min(reply.batched for reply in replies))
        assert batched == [len(lengths)] * len(rounds), batched  # each message's steps ran as one block call
        assert metric(node, "layerswarm_node_decode_batch_size_count") - calls_before == len(rounds)
        assert metric(node, "layerswarm_node_requests_total", rpc="DecodeBatchStream") == 1 + len(rounds)
        assert metric(node, "layerswarm_node_decode_batch_steps_total") == (1 + len(rounds)) * len(lengths)
        await batches.end()

        ref = LocalStream(block)  # and both equal the block itself
        ref.step(prompts[0])
        for r in range(4):
            assert (alone[r][0] - ref.step(rounds[r][0], starts[r][0])).abs().max().item() < TOL


async def test_a_streams_steps_in_one_batch_run_in_their_order(lm: tuple[DecoderLM, Path], block: DecoderBlock) -> None:
    async with serving(lm[1]) as (_node, stub):
        prompt, x1, x2, verify = x_(4), x_(), x_(), x_(3)
        batches = Batches(stub)
        replies = await batches.send(
            [
                decode_request("s", 0, prompt),
                decode_request("other", 0, x_(2)),
                decode_request("s", 4, x1),
                decode_request("s", 5, x2),
                decode_request("s", 5, verify),  # rolls back the step before it
            ]
        )
        assert [r.refused for r in replies] == [""] * 5
        assert [r.length for r in replies] == [4, 2, 5, 6, 8]
        ref = LocalStream(block)
        ref.step(prompt)
        for reply, x, start in ((replies[2], x1, 4), (replies[3], x2, 5), (replies[4], verify, 5)):
            assert (out_of(reply) - ref.step(x, start)).abs().max().item() < TOL
        await batches.end()


async def test_a_batch_over_the_step_limit_ends_the_call_with_invalid_argument_and_runs_nothing(
    lm: tuple[DecoderLM, Path],
) -> None:
    async with serving(lm[1]) as (node, stub):
        await stub.Decode(decode_request("elsewhere", 0, x_(2)))  # another call's stream: untouched
        batches = Batches(stub)
        assert [r.length for r in await batches.send([decode_request("mine", 0, x_(2))])] == [2]
        over = [decode_request(f"o{i}", 0, x_()) for i in range(MAX_DECODE_BATCH_STEPS + 1)]
        await batches.queue.put(batch(over))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await batches.call.read()
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {MAX_DECODE_BATCH_STEPS}" in (caught.value.details() or "")
        service = node.decode
        assert service is not None
        assert not any(f"o{i}" in service.table for i in range(len(over)))  # none of its steps ran
        await wait_until(lambda: "mine" not in service.table, 5.0, "the call's end")  # as any call's end
        assert metric(node, "layerswarm_node_errors_total", code="INVALID_ARGUMENT") == 1
        assert (await stub.Decode(decode_request("elsewhere", 2, x_()))).length == 3
        # at the limit, a message is served
        exact = Batches(stub)
        replies = await exact.send(decode_request(f"e{i}", 0, x_()) for i in range(MAX_DECODE_BATCH_STEPS))
        assert [r.length for r in replies] == [1] * MAX_DECODE_BATCH_STEPS
        await exact.end()


async def test_another_callers_stream_in_a_batch_is_refused_that_step_alone_and_changes_nothing(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    async with serving(lm[1]) as (node, mine):
        prompt = x_(5)
        await mine.Decode(decode_request("owned", 0, prompt))
        async with proxy_from("127.0.0.2", node.port) as port, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            theirs = Batches(pb_grpc.BlockNodeStub(ch))
            replies = await theirs.send(
                [
                    decode_request("t1", 0, x_(2)),
                    decode_request("owned", 5, x_()),  # step it
                    decode_request("owned", 0, x_(3)),  # restart it
                    decode_request("t2", 0, x_(3)),
                ]
            )
            assert [r.refused for r in replies] == ["", "PERMISSION_DENIED", "PERMISSION_DENIED", ""]
            assert "belongs to another caller" in replies[1].error
            assert [replies[0].length, replies[3].length] == [2, 3]
            await theirs.end()
        ref = LocalStream(block)
        ref.step(prompt)
        x = x_()
        reply = await mine.Decode(decode_request("owned", 5, x))  # untouched by all of it
        assert reply.length == 6 and (out_of(reply) - ref.step(x)).abs().max().item() < TOL
        assert metric(node, "layerswarm_node_errors_total", code="PERMISSION_DENIED") == 2


async def test_the_end_of_a_batch_call_frees_its_streams_and_only_those(lm: tuple[DecoderLM, Path]) -> None:
    async with serving(lm[1]) as (node, stub):
        await stub.Decode(decode_request("unary", 0, x_(3)))
        closed = Batches(stub)
        assert len(await closed.send(decode_request(f"s{i}", 0, x_(2)) for i in range(4))) == 4
        cancelled = Batches(stub)
        assert len(await cancelled.send(decode_request(f"c{i}", 0, x_(2)) for i in range(3))) == 3
        exc = await refusal(stub.Decode(decode_request("c0", 2, x_())))  # same host, another call
        assert exc.code() is grpc.StatusCode.PERMISSION_DENIED
        assert metric(node, "layerswarm_node_streams_open") == 8
        await closed.end()
        await wait_until(lambda: metric(node, "layerswarm_node_streams_open") == 4, 5.0, "a closed call's end")
        cancelled.call.cancel()
        await wait_until(lambda: metric(node, "layerswarm_node_streams_open") == 1, 5.0, "a cancelled call's end")
        exc = await refusal(stub.Decode(decode_request("s0", 2, x_())))
        assert exc.code() is grpc.StatusCode.NOT_FOUND and "DecodeStream it was opened over ended" in (
            exc.details() or ""
        )
        assert metric(node, "layerswarm_node_stream_evictions_total", reason="stream_ended") == 7
        assert (await stub.Decode(decode_request("unary", 3, x_()))).length == 4


async def test_a_classifier_block_refuses_decode_batches(model_dir: Path) -> None:
    async with serving(model_dir) as (_node, stub):
        call = stub.DecodeBatchStream(iter([batch([decode_request("s", 0, torch.randn(1, 1, 32))])]))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in call]
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a decoder block" in (caught.value.details() or "")


async def test_the_swarm_token_guards_decode_batches(lm: tuple[DecoderLM, Path]) -> None:
    async with serving(lm[1], security=SecuritySettings(token="batch-s3cret")) as (node, stub):
        call = stub.DecodeBatchStream(iter([batch([decode_request("t", 0, x_(2))])]))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in call]
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert node.decode is not None and len(node.decode.table) == 0
