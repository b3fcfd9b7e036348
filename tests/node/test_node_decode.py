"""A decoder node over real gRPC on loopback: its streams' KV caches (prefill, decode, rollback, CALM fill),
continuous batching, limits and eviction, ownership, and every refusal's status code.

In-process nodes (as tests/node/test_node.py) for the server's behaviour; real node processes for a chain of
blocks against the monolith and for memory (tests/node/test_node_decode_procs.py)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from layerswarm.models.checkpoint import load_block, read_lm_manifest
from layerswarm.models.lm.model import DecoderBlock, DecoderLM
from layerswarm.node.decode import INLINE_MAX_TOKENS
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.auth import NONCE_KEY, CallSigner, info_identity
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from ..lm_nodes import TOL, LocalStream, decode_request, make_lm_dir, out_of, proxy_from, refusal
from ..swarm import wait_until

D = 32


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[DecoderLM, Path]:
    path = tmp_path_factory.mktemp("lm") / "model"
    return make_lm_dir(path), path


@pytest.fixture(scope="module")
def block(lm: tuple[DecoderLM, Path]) -> DecoderBlock:
    return load_block(lm[1], 1, read_lm_manifest(lm[1]))


@asynccontextmanager
async def serving(
    model_dir: Path, block: int = 1, **settings: Any
) -> AsyncIterator[tuple[Node, pb_grpc.BlockNodeStub]]:
    # The torch engine, named: these tests hold the node to the torch block bit for bit (TOL, torch.equal);
    # `auto` would pick numpy for a decoder on the CPU, which test_lean_engine.py holds to LEAN_TOL.
    settings.setdefault("engine", "torch")
    node = Node(NodeSettings(model_dir=model_dir, block=block, advertise=False, grace_s=0.2, **settings))
    await node.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
            yield node, pb_grpc.BlockNodeStub(channel)
    finally:
        await node.stop()


def metric(node: Node, name: str, **labels: str) -> float:
    value = node.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def x_(t: int = 1) -> torch.Tensor:
    return torch.randn(1, t, D)


# -- serving a decoder block ----------------------------------------------------------------------------


async def test_info_reports_the_decoder_block_and_its_stream_limits(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    path = lm[1]
    async with serving(path, max_streams=5, max_cache_mib=2.0, idle_timeout_s=7.5) as (node, stub):
        info = await stub.Info(pb.InfoRequest())
        manifest = read_lm_manifest(path)
        assert (info.block_index, info.depth, info.dim, info.tokens) == (1, 3, D, 64)
        assert info.model_id == manifest.model_id and info.weights_sha256 == manifest.block_sha256(1)
        assert info.shuffle_robust and info.variant == "layershuffle"
        limits = info.stream_limits
        assert (limits.max_streams, limits.max_seq_len, limits.max_cache_bytes, limits.idle_timeout_s) == (
            5,
            64,
            2 * 1024 * 1024,
            7.5,
        )
        # Forward: the block over whole sequences from position 0, no cache (what a peer re-executes)
        x = torch.randn(2, 9, D)
        reply = await stub.Forward(pb.ForwardRequest(activations=codec.encode(x), position=2))
        with torch.inference_mode():
            assert torch.equal(codec.decode(reply.activations), block(x))
        for bad, detail in (
            (pb.ForwardRequest(activations=codec.encode(torch.randn(1, 65, D))), "65 tokens; this family takes 64"),
            (
                pb.ForwardRequest(activations=codec.encode(x), token_mask=codec.encode(torch.ones(2, 9))),
                "this is a decoder block",
            ),
        ):
            exc = await refusal(stub.Forward(bad))
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT and detail in (exc.details() or "")
        assert len(node.decode.table) == 0  # type: ignore[union-attr]  # Forward holds no stream


async def test_a_classifier_block_refuses_generation(model_dir: Path) -> None:
    async with serving(model_dir) as (_node, stub):
        info = await stub.Info(pb.InfoRequest())
        assert not info.HasField("stream_limits") or info.stream_limits.max_streams == 0
        calls = (
            stub.Decode(decode_request("s", 0, torch.randn(1, 1, 32))),
            stub.Release(pb.ReleaseRequest(stream_ids=["s"])),
        )
        for call in calls:
            exc = await refusal(call)
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT and "not a decoder block" in (exc.details() or "")
        stream = stub.DecodeStream(iter([decode_request("s", 0, torch.randn(1, 1, 32))]))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in stream]
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


# -- one stream: prefill, steps, rollback, CALM fill ----------------------------------------------------


async def test_prefill_steps_and_rollback_equal_the_block_with_its_own_cache(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    torch.manual_seed(1)
    async with serving(lm[1]) as (node, stub):
        ref = LocalStream(block)
        prompt = x_(9)
        reply = await stub.Decode(decode_request("s1", 0, prompt))
        assert reply.length == 9 and reply.batched == 1 and reply.stream_id == "s1"
        worst = (out_of(reply) - ref.step(prompt)).abs().max().item()
        accepted = [prompt]
        for start in range(9, 14):  # five decode steps
            x = x_()
            reply = await stub.Decode(decode_request("s1", start, x))
            worst = max(worst, (out_of(reply) - ref.step(x)).abs().max().item())
            assert reply.length == start + 1
            accepted.append(x)
        assert worst < TOL, worst
        drafts = x_(4)
        assert (await stub.Decode(decode_request("s1", 14, drafts))).length == 18  # four drafts
        verify = x_(3)  # two accepted: the verify starts at 16, so the node drops the other two first
        reply = await stub.Decode(decode_request("s1", 16, verify))
        assert reply.length == 19 and node.decode.table.held("s1") == 19  # type: ignore[union-attr]
        # a fresh computation: the whole accepted sequence through the block at once, no cache at all
        sequence = torch.cat([*accepted, drafts[:, :2], verify], dim=1)
        with torch.inference_mode():
            fresh = block(sequence)[:, 16:]
        assert (out_of(reply) - fresh).abs().max().item() < TOL


async def test_kv_only_and_fill_leave_the_cache_a_calm_exit_leaves(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    """CALM: a token that exited before this block still gets its keys and values here, from its exit
    state: either as a kv_only call (no output) or as the next step's fill (no extra trip)."""
    async with serving(lm[1]) as (_node, stub):
        prompt, exited, nxt, exited2, nxt2 = x_(6), x_(), x_(), x_(2), x_()
        ref = LocalStream(block)
        ref.step(prompt)
        ref.fill(exited)
        expected = ref.step(nxt)
        ref.fill(exited2)
        expected2 = ref.step(nxt2)
        await stub.Decode(decode_request("c", 0, prompt))
        reply = await stub.Decode(decode_request("c", 6, exited, kv_only=True))
        assert reply.length == 7 and not reply.HasField("activations")
        reply = await stub.Decode(decode_request("c", 7, nxt))
        assert (out_of(reply) - expected).abs().max().item() < TOL
        fill = codec.encode(exited2)
        reply = await stub.Decode(decode_request("c", 8, nxt2, fill=fill))  # fill at 8, 9; the token at 10
        assert reply.length == 11 and tuple(out_of(reply).shape) == (1, 1, D)
        assert (out_of(reply) - expected2).abs().max().item() < TOL


# -- batching --------------------------------------------------------------------------------------------


async def test_concurrent_streams_batch_into_one_call_and_equal_each_stream_alone(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    torch.manual_seed(2)
    lengths = [3, 11, 6, 1, 17, 8, 2, 5]
    async with serving(lm[1]) as (node, stub):
        refs = [LocalStream(block) for _ in lengths]
        for i, n in enumerate(lengths):
            prompt = x_(n)
            await stub.Decode(decode_request(f"b{i}", 0, prompt))
            refs[i].step(prompt)
        seen: list[int] = []
        worst = 0.0
        for round_ in range(4):
            t = 3 if round_ == 2 else 1  # one round of T = 3 verifies, batched among themselves
            xs = [x_(t) for _ in lengths]
            starts = [n + (round_ if round_ < 3 else round_ + 2) for n in lengths]
            replies = await asyncio.gather(
                *(stub.Decode(decode_request(f"b{i}", starts[i], xs[i])) for i in range(len(lengths)))
            )
            for i, reply in enumerate(replies):
                worst = max(worst, (out_of(reply) - refs[i].step(xs[i])).abs().max().item())
                seen.append(reply.batched)
        assert worst < TOL, worst
        assert max(seen) > 1, seen  # steps of different streams (different lengths) shared a block call
        calls = metric(node, "layerswarm_node_decode_batch_size_count")
        assert calls < len(seen) + len(lengths)  # fewer block calls than steps
        assert metric(node, "layerswarm_node_decode_steps_total", kind="step") == 3 * len(lengths)
        assert metric(node, "layerswarm_node_decode_steps_total", kind="verify") == len(lengths)


async def test_a_lone_streams_quick_steps_run_inline_and_equal_the_block_and_two_streams_use_the_thread(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    torch.manual_seed(4)
    async with serving(lm[1]) as (node, stub):
        service = node.decode
        assert service is not None
        ref = LocalStream(block)
        prompt = x_(5)
        await stub.Decode(decode_request("a", 0, prompt))
        ref.step(prompt)
        worst = 0.0
        for start in range(5, 13):
            x = x_()
            reply = await stub.Decode(decode_request("a", start, x))
            worst = max(worst, (out_of(reply) - ref.step(x)).abs().max().item())
        assert worst < TOL, worst
        assert service.inline_steps >= 6, service.inline_steps  # the first one-token step measures on the thread
        inline = service.inline_steps
        await stub.Decode(decode_request("b", 0, x_(3)))  # a second stream: steps may batch, so no inline step
        for round_ in range(3):
            await asyncio.gather(
                stub.Decode(decode_request("a", 13 + round_, x_())), stub.Decode(decode_request("b", 3 + round_, x_()))
            )
        assert service.inline_steps == inline


async def test_a_lone_streams_verify_steps_run_inline_after_one_of_their_size_and_a_prefill_never(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    """A speculative verify (k + 1 tokens) is as short as a step on a small block: after one verify of its
    size measured on the thread, the next ones compute on the event loop, with the block's own output. A
    prefill longer than INLINE_MAX_TOKENS always goes to the thread."""
    torch.manual_seed(5)
    async with serving(lm[1]) as (node, stub):
        service = node.decode
        assert service is not None
        ref = LocalStream(block)
        prompt = x_(INLINE_MAX_TOKENS + 3)
        await stub.Decode(decode_request("a", 0, prompt))
        ref.step(prompt)
        assert service.inline_steps == 0
        start, worst = prompt.shape[1], 0.0
        for _ in range(5):
            x = x_(5)
            reply = await stub.Decode(decode_request("a", start, x))
            worst = max(worst, (out_of(reply) - ref.step(x)).abs().max().item())
            start += 5
        assert worst < TOL, worst
        assert service.inline_steps == 4, service.inline_steps  # the first verify of 5 measured on the thread
        await stub.Decode(decode_request("b", 0, x_(INLINE_MAX_TOKENS + 1)))  # a prefill: never inline
        assert service.inline_steps == 4


async def test_a_block_slower_than_the_inline_limit_computes_on_its_thread(
    lm: tuple[DecoderLM, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("layerswarm.node.decode.INLINE_MAX_MS", 0.0)
    async with serving(lm[1]) as (node, stub):
        await stub.Decode(decode_request("a", 0, x_(2)))
        for start in range(2, 8):
            await stub.Decode(decode_request("a", start, x_()))
        assert node.decode is not None and node.decode.inline_steps == 0


# -- refusals: each status, and nothing changes -----------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "detail"),
    [
        (lambda: decode_request("s", 5, torch.randn(2, 1, D)), "dim 0 is 2"),
        (lambda: decode_request("s", 5, torch.randn(1, 1, D + 1)), "dim 2 is 33"),
        (lambda: decode_request("s", 5, torch.full((1, 1, D), float("nan"))), "NaN"),
        (lambda: decode_request("s", 5, torch.full((1, 1, D), float("inf"))), "NaN or Inf"),
        (lambda: decode_request("s", 5, torch.full((1, 1, D), 40000.0).half()), "out of range"),
        (lambda: decode_request("s", 5, torch.randn(1, 0, D)), "dim 1 is 0"),
        (lambda: pb.DecodeRequest(stream_id="s", start=5), "no activations"),
        (lambda: decode_request("", 0, torch.randn(1, 1, D)), "stream_id"),
        (lambda: decode_request("x" * 129, 0, torch.randn(1, 1, D)), "stream_id"),
        (lambda: decode_request("s s", 0, torch.randn(1, 1, D)), "stream_id"),
        (lambda: decode_request("s", -1, torch.randn(1, 1, D)), "negative"),
        (lambda: decode_request("s", 5, torch.randn(1, 1, D), fill=codec.encode(torch.randn(1, 1, 7))), "fill"),
        (lambda: decode_request("s", 5, torch.randn(1, 1, D), reply_dtype=9), "dtype"),
    ],
)
async def test_bad_steps_get_invalid_argument_and_change_nothing(
    lm: tuple[DecoderLM, Path], block: DecoderBlock, make: Callable[[], pb.DecodeRequest], detail: str
) -> None:
    async with serving(lm[1]) as (node, stub):
        prompt, x = x_(5), x_()
        await stub.Decode(decode_request("s", 0, prompt))
        exc = await refusal(stub.Decode(make()))
        assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, exc.details()
        assert detail in (exc.details() or ""), exc.details()
        ref = LocalStream(block)
        ref.step(prompt)
        reply = await stub.Decode(decode_request("s", 5, x))
        assert reply.length == 6 and (out_of(reply) - ref.step(x)).abs().max().item() < TOL
        assert len(node.decode.table) == 1  # type: ignore[union-attr]


async def test_stream_states_get_precise_codes_and_a_refused_step_changes_nothing(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    async with serving(lm[1]) as (_node, stub):
        prompt, x = x_(10), x_()
        await stub.Decode(decode_request("s", 0, prompt))
        cases = [
            (decode_request("ghost", 3, x), grpc.StatusCode.NOT_FOUND, "stream ghost unknown"),
            (decode_request("s", 11, x), grpc.StatusCode.FAILED_PRECONDITION, "holds 10 tokens here"),
            (decode_request("s", 10, x_(55)), grpc.StatusCode.RESOURCE_EXHAUSTED, "the context is 64"),
            (
                decode_request("s", 10, x_(50), fill=codec.encode(x_(5))),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "would hold 65 tokens",
            ),
        ]
        for request, code, detail in cases:
            exc = await refusal(stub.Decode(request))
            assert exc.code() is code and detail in (exc.details() or ""), exc.details()
        ref = LocalStream(block)
        ref.step(prompt)
        reply = await stub.Decode(decode_request("s", 10, x))
        assert reply.length == 11 and (out_of(reply) - ref.step(x)).abs().max().item() < TOL
        # a new stream whose first step is refused is not kept (its id stays unknown)
        exc = await refusal(stub.Decode(decode_request("fresh", 0, x_(70))))
        assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        exc = await refusal(stub.Decode(decode_request("fresh", 1, x)))
        assert exc.code() is grpc.StatusCode.NOT_FOUND and "unknown" in (exc.details() or "")


async def test_a_refused_step_on_a_decodestream_is_a_reply_and_the_stream_goes_on(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    async with serving(lm[1]) as (_node, stub):
        prompt, x = x_(4), x_()
        requests = [
            decode_request("a", 0, prompt),
            decode_request("a", 9, x),  # ahead of what it holds
            decode_request("nobody", 2, x),
            decode_request("a", 4, torch.full((1, 1, D), float("nan"))),
            decode_request("a", 4, x),
        ]
        replies = [r async for r in stub.DecodeStream(iter(requests))]
        assert [r.refused for r in replies] == ["", "FAILED_PRECONDITION", "NOT_FOUND", "INVALID_ARGUMENT", ""]
        assert [r.stream_id for r in replies] == ["a", "a", "nobody", "a", "a"]
        assert "holds 4 tokens" in replies[1].error and "unknown" in replies[2].error
        ref = LocalStream(block)
        ref.step(prompt)
        assert replies[4].length == 5 and (out_of(replies[4]) - ref.step(x)).abs().max().item() < TOL


# -- limits and eviction ------------------------------------------------------------------------------


async def test_the_oldest_idle_stream_is_evicted_first_and_its_caller_hears_why(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    async with serving(lm[1], max_streams=3) as (node, stub):
        refs = {sid: LocalStream(block) for sid in "abcd"}
        lengths = {}
        for sid in "abc":
            prompt = x_(4)
            await stub.Decode(decode_request(sid, 0, prompt))
            refs[sid].step(prompt)
            lengths[sid] = 4
        x = x_()
        await stub.Decode(decode_request("a", 4, x))  # a is touched: b is now the oldest idle stream
        refs["a"].step(x)
        lengths["a"] = 5
        prompt = x_(2)
        await stub.Decode(decode_request("d", 0, prompt))
        refs["d"].step(prompt)
        lengths["d"] = 2
        exc = await refusal(stub.Decode(decode_request("b", 4, x_())))
        assert exc.code() is grpc.StatusCode.NOT_FOUND
        assert "stream b evicted (least recently used" in (exc.details() or ""), exc.details()
        for sid in "acd":  # the others are untouched
            x = x_()
            reply = await stub.Decode(decode_request(sid, lengths[sid], x))
            assert (out_of(reply) - refs[sid].step(x)).abs().max().item() < TOL
        assert metric(node, "layerswarm_node_stream_evictions_total", reason="slots") == 1
        assert metric(node, "layerswarm_node_streams_open") == 3


async def test_a_flood_of_new_streams_evicts_the_oldest_refuses_clearly_and_disturbs_nothing_else(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    async with serving(lm[1], max_streams=8) as (node, stub):
        await stub.Decode(decode_request("old", 0, x_(5)))
        prompts = [x_(3) for _ in range(60)]
        flood = [stub.Decode(decode_request(f"f{i}", 0, p)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*flood, return_exceptions=True)
        codes = {r.code() if isinstance(r, grpc.aio.AioRpcError) else grpc.StatusCode.OK for r in results}
        assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        busy = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert all("stream slots are in a step" in (r.details() or "") for r in busy)
        assert metric(node, "layerswarm_node_streams_open") == 8
        exc = await refusal(stub.Decode(decode_request("old", 5, x_())))  # the oldest went first
        assert exc.code() is grpc.StatusCode.NOT_FOUND and "evicted (least recently used" in (exc.details() or "")
        survivors = [int(s.id[1:]) for s in node.decode.table.streams()]  # type: ignore[union-attr]
        assert len(survivors) == 8 and all(isinstance(results[i], pb.DecodeResponse) for i in survivors)
        for i in survivors:  # the streams the node still holds are intact
            ref = LocalStream(block)
            ref.step(prompts[i])
            x = x_()
            reply = await stub.Decode(decode_request(f"f{i}", 3, x))
            assert reply.length == 4 and (out_of(reply) - ref.step(x)).abs().max().item() < TOL
        evicted = metric(node, "layerswarm_node_stream_evictions_total", reason="slots")
        assert evicted == 60 - len(busy) + 1 - 8  # every stream opened, less the eight held


async def test_the_byte_bound_refuses_a_stream_that_cannot_fit_and_evicts_for_one_that_can(
    lm: tuple[DecoderLM, Path],
) -> None:
    # one token of this block's cache: keys and values of 2 heads of 8 floats = 128 bytes; 16 tokens of
    # first allocation = 2 KiB; 64 tokens = 8 KiB. A 6 KiB cache holds three fresh streams.
    async with serving(lm[1], max_cache_mib=6 / 1024) as (node, stub):
        for sid in "abc":
            await stub.Decode(decode_request(sid, 0, x_(4)))
        assert metric(node, "layerswarm_node_cache_bytes") == 3 * 2048
        exc = await refusal(stub.Decode(decode_request("big", 0, x_(60))))  # 8 KiB alone: never fits
        assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "more bytes of cache" in (exc.details() or "")
        assert metric(node, "layerswarm_node_streams_open") == 3  # nobody was evicted for it
        await stub.Decode(decode_request("d", 0, x_(4)))  # fits once the oldest goes
        assert metric(node, "layerswarm_node_stream_evictions_total", reason="bytes") == 1
        exc = await refusal(stub.Decode(decode_request("a", 4, x_())))
        assert "the node's 6144-byte cache was full" in (exc.details() or "")


async def test_the_idle_timeout_frees_streams_and_says_so(lm: tuple[DecoderLM, Path]) -> None:
    async with serving(lm[1], idle_timeout_s=0.3) as (node, stub):
        for sid in ("i1", "i2", "i3"):
            await stub.Decode(decode_request(sid, 0, x_(4)))
        assert metric(node, "layerswarm_node_streams_open") == 3
        await wait_until(lambda: metric(node, "layerswarm_node_streams_open") == 0, 5.0, "the idle sweep")
        assert metric(node, "layerswarm_node_cache_bytes") == 0 and metric(node, "layerswarm_node_tokens_held") == 0
        exc = await refusal(stub.Decode(decode_request("i1", 4, x_())))
        assert exc.code() is grpc.StatusCode.NOT_FOUND and "idle for more than 0.3 s" in (exc.details() or "")
        assert metric(node, "layerswarm_node_stream_evictions_total", reason="idle") == 3
        assert node.decode.sweeper.running and node.decode.sweeper.errors == 0  # type: ignore[union-attr]


async def test_the_end_of_a_decodestream_frees_its_streams_and_only_those(lm: tuple[DecoderLM, Path]) -> None:
    async with serving(lm[1]) as (node, stub):
        await stub.Decode(decode_request("unary", 0, x_(3)))
        replies = [r async for r in stub.DecodeStream(iter([decode_request(f"s{i}", 0, x_(2)) for i in range(4)]))]
        assert all(r.length == 2 for r in replies)
        await wait_until(lambda: metric(node, "layerswarm_node_streams_open") == 1, 5.0, "the stream's end")
        exc = await refusal(stub.Decode(decode_request("s0", 2, x_())))
        assert exc.code() is grpc.StatusCode.NOT_FOUND and "DecodeStream it was opened over ended" in (
            exc.details() or ""
        )
        # a caller that goes away mid-stream (cancels) frees its streams too
        queue: asyncio.Queue[pb.DecodeRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.DecodeRequest]:
            while (item := await queue.get()) is not None:
                yield item

        call = stub.DecodeStream(requests())
        for i in range(3):
            await queue.put(decode_request(f"c{i}", 0, x_(2)))
            assert (await call.read()).length == 2
        assert metric(node, "layerswarm_node_streams_open") == 4
        call.cancel()
        await wait_until(lambda: metric(node, "layerswarm_node_streams_open") == 1, 5.0, "a cancelled stream's end")
        assert metric(node, "layerswarm_node_stream_evictions_total", reason="stream_ended") == 7
        assert (await stub.Decode(decode_request("unary", 3, x_()))).length == 4


async def test_release_frees_by_flag_and_by_call(lm: tuple[DecoderLM, Path]) -> None:
    async with serving(lm[1]) as (node, stub):
        for sid in ("r1", "r2", "r3"):
            await stub.Decode(decode_request(sid, 0, x_(3)))
        reply = await stub.Decode(decode_request("r1", 3, x_(), release=True))
        assert reply.length == 4 and "r1" not in node.decode.table  # type: ignore[union-attr]
        assert (await stub.Release(pb.ReleaseRequest(stream_ids=["r2", "r3", "never"]))).released == 2
        assert (await stub.Release(pb.ReleaseRequest(stream_ids=["r2"]))).released == 0
        exc = await refusal(stub.Decode(decode_request("r2", 3, x_())))
        assert exc.code() is grpc.StatusCode.NOT_FOUND and "released" in (exc.details() or "")
        assert metric(node, "layerswarm_node_streams_released_total") == 3
        assert metric(node, "layerswarm_node_streams_open") == 0 and metric(node, "layerswarm_node_cache_bytes") == 0


# -- who may step a stream ----------------------------------------------------------------------------


async def test_another_peer_cannot_step_or_release_a_stream_and_changes_nothing(
    lm: tuple[DecoderLM, Path], block: DecoderBlock
) -> None:
    """Two callers on different loopback addresses (127.0.0.1, and 127.0.0.2 through a proxy): the
    second knows the first's stream id and still cannot use it."""
    async with serving(lm[1]) as (node, mine):
        async with proxy_from("127.0.0.2", node.port) as port, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            theirs = pb_grpc.BlockNodeStub(ch)
            prompt = x_(6)
            await mine.Decode(decode_request("owned", 0, prompt))
            for call in (
                theirs.Decode(decode_request("owned", 6, x_())),
                theirs.Decode(decode_request("owned", 0, x_(2))),  # nor restart it
                theirs.Release(pb.ReleaseRequest(stream_ids=["owned"])),
            ):
                exc = await refusal(call)
                assert exc.code() is grpc.StatusCode.PERMISSION_DENIED, exc.details()
                assert "belongs to another caller" in (exc.details() or "")
            replies = [r async for r in theirs.DecodeStream(iter([decode_request("owned", 6, x_())]))]
            assert replies[0].refused == "PERMISSION_DENIED"
            await theirs.Decode(decode_request("theirs", 0, x_(2)))  # their own stream is theirs
            exc = await refusal(mine.Release(pb.ReleaseRequest(stream_ids=["theirs"])))
            assert exc.code() is grpc.StatusCode.PERMISSION_DENIED
            assert (await theirs.Release(pb.ReleaseRequest(stream_ids=["theirs"]))).released == 1
        ref = LocalStream(block)
        ref.step(prompt)
        x = x_()
        reply = await mine.Decode(decode_request("owned", 6, x))  # untouched by all of it
        assert reply.length == 7 and (out_of(reply) - ref.step(x)).abs().max().item() < TOL
        assert metric(node, "layerswarm_node_errors_total", code="PERMISSION_DENIED") == 5


async def test_a_stream_opened_over_a_decodestream_is_stepped_only_over_it(lm: tuple[DecoderLM, Path]) -> None:
    async with serving(lm[1]) as (_node, stub):
        queue: asyncio.Queue[pb.DecodeRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.DecodeRequest]:
            while (item := await queue.get()) is not None:
                yield item

        call = stub.DecodeStream(requests())
        await queue.put(decode_request("bound", 0, x_(3)))
        assert (await call.read()).length == 3
        exc = await refusal(stub.Decode(decode_request("bound", 3, x_())))  # same host, another call
        assert exc.code() is grpc.StatusCode.PERMISSION_DENIED and "another DecodeStream" in (exc.details() or "")
        await queue.put(decode_request("bound", 3, x_()))
        assert (await call.read()).length == 4
        await queue.put(None)
        assert await call.read() is grpc.aio.EOF and await call.code() is grpc.StatusCode.OK


# -- the swarm token ----------------------------------------------------------------------------------


async def test_the_swarm_token_guards_decode_decodestream_and_release(lm: tuple[DecoderLM, Path]) -> None:
    token = "decode-s3cret"
    async with serving(lm[1], security=SecuritySettings(token=token)) as (_node, stub):
        calls = (
            stub.Decode(decode_request("t", 0, x_(2))),
            stub.Release(pb.ReleaseRequest(stream_ids=["t"])),
        )
        for call in calls:
            exc = await refusal(call)
            assert exc.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in stub.DecodeStream(iter([decode_request("t", 0, x_(2))]))]
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        signer = CallSigner(token)
        nonce = signer.new_nonce()
        info = stub.Info(pb.InfoRequest(), metadata=((NONCE_KEY, nonce),))
        assert signer.accept_info(await info.trailing_metadata(), nonce, info_identity(await info))
        method = "/layerswarm.v1.BlockNode/"
        reply = await stub.Decode(decode_request("t", 0, x_(2)), metadata=(signer.sign(method + "Decode"),))
        assert reply.length == 2
        stream = stub.DecodeStream(
            iter([decode_request("u", 0, x_(2))]), metadata=(signer.sign(method + "DecodeStream"),)
        )
        assert [r.length async for r in stream] == [2]
        released = await stub.Release(pb.ReleaseRequest(stream_ids=["t"]), metadata=(signer.sign(method + "Release"),))
        assert released.released == 1


async def test_under_mutual_tls_the_certificate_is_part_of_who_owns_a_stream(
    lm: tuple[DecoderLM, Path], tmp_path: Path
) -> None:
    """Two coordinator certificates of one swarm (the second from a rotation of the first folder: same
    CA, same name, another key) on the same host: each is its own caller."""
    root = Path(__file__).resolve().parents[2]
    first, second = tmp_path / "first", tmp_path / "second"
    subprocess.run(["bash", str(root / "deploy" / "make-certs.sh"), str(first)], check=True, capture_output=True)
    shutil.copytree(first, second)
    subprocess.run(["bash", str(root / "deploy" / "make-certs.sh"), str(second)], check=True, capture_output=True)
    assert (first / "coordinator.pem").read_bytes() != (second / "coordinator.pem").read_bytes()
    node_tls = SecuritySettings.from_files(None, first / "node.pem", first / "node.key", first / "ca.pem")
    node = Node(NodeSettings(model_dir=lm[1], block=1, advertise=False, grace_s=0.2, security=node_tls))
    await node.start()
    options = [("grpc.ssl_target_name_override", "layerswarm-node")]
    try:
        stubs = []
        for folder in (first, second):
            tls = SecuritySettings.from_files(
                None, folder / "coordinator.pem", folder / "coordinator.key", folder / "ca.pem"
            )
            channel = grpc.aio.secure_channel(f"127.0.0.1:{node.port}", tls.channel_credentials(), options)
            stubs.append((channel, pb_grpc.BlockNodeStub(channel)))
        (_, one), (_, two) = stubs
        await one.Decode(decode_request("tls", 0, x_(3)))
        exc = await refusal(two.Decode(decode_request("tls", 3, x_())))
        assert exc.code() is grpc.StatusCode.PERMISSION_DENIED
        assert (await one.Decode(decode_request("tls", 3, x_()))).length == 4
        [owner] = [s.owner.principal for s in node.decode.table.streams()]  # type: ignore[union-attr]
        assert owner.startswith("host 127.0.0.1 cert ")
        for channel, _ in stubs:
            await channel.close()
    finally:
        await node.stop()
