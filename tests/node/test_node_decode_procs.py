"""Decoder nodes as real processes (`layerswarm node`): a chain of them, one per block, generates what the
monolith does; and a node's memory comes back after a thousand finished or abandoned streams."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from layerswarm.harness.procs import Proc, layerswarm_cmd, node_address, stop_all
from layerswarm.models.checkpoint import block_file
from layerswarm.models.lm.model import DecoderLM
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from ..lm_nodes import TOL, decode_request, free_port, make_lm_dir, out_of
from ..swarm import start_nodes

pytestmark = pytest.mark.slow
WARM_UP = 200  # streams before the idle reading


class Hop:
    """One node of the chain, stepped over its own DecodeStream (as a coordinator would) or by unary
    Decode calls."""

    def __init__(self, stub: pb_grpc.BlockNodeStub, streamed: bool) -> None:
        self.stub = stub
        self.queue: asyncio.Queue[pb.DecodeRequest | None] = asyncio.Queue()
        self.call = stub.DecodeStream(self._requests()) if streamed else None

    async def _requests(self) -> AsyncIterator[pb.DecodeRequest]:
        while (item := await self.queue.get()) is not None:
            yield item

    async def step(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        if self.call is None:
            return await self.stub.Decode(request)
        await self.queue.put(request)
        reply = await self.call.read()
        assert not reply.refused, reply.error
        return reply

    async def close(self) -> None:
        if self.call is not None:
            await self.queue.put(None)
            assert await self.call.read() is grpc.aio.EOF


async def through(hops: list[Hop], stream_id: str, start: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (1, T, D) through every hop; the last hop's output and the tokens every node now holds."""
    lengths = set()
    for hop in hops:
        reply = await hop.step(decode_request(stream_id, start, x))
        x = out_of(reply)
        lengths.add(reply.length)
    assert len(lengths) == 1, lengths
    return x, lengths.pop()


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[DecoderLM, list[Proc]]:
    path = tmp_path_factory.mktemp("lm-chain") / "model"
    model = make_lm_dir(path, seed=3, depth=4, max_seq_len=96)
    nodes = start_nodes([(path, b) for b in range(4)])
    yield model, nodes  # type: ignore[misc]
    stop_all(nodes)


async def test_a_chain_of_node_processes_generates_what_the_monolith_does(chain: tuple[DecoderLM, list[Proc]]) -> None:
    """Prefill, then decode token by token through four node processes (one per block; two stepped over
    a DecodeStream, two by unary calls): the logits at every position equal the monolith's full forward
    over the same tokens, greedy tokens equal DecoderLM.generate's, and a speculative verify with the
    start rolled back gives the monolith's logits over the accepted tokens."""
    model, nodes = chain
    channels = [grpc.aio.insecure_channel(node_address(n)) for n in nodes]
    hops = [Hop(pb_grpc.BlockNodeStub(c), streamed=i % 2 == 0) for i, c in enumerate(channels)]
    try:
        prompt = [1, 17, 43, 8, 90, 22, 5, 61, 33, 70]
        with torch.inference_mode():
            x, held = await through(hops, "gen", 0, model.stem(torch.tensor([prompt])))
            logits = [model.head(x)[0]]
            tokens = list(prompt)
            for _ in range(24):
                token = int(logits[-1][-1].argmax())
                tokens.append(token)
                x, held = await through(hops, "gen", held, model.stem(torch.tensor([[token]])))
                logits.append(model.head(x)[0])
            swarm = torch.cat(logits)  # (len(tokens), V)
            monolith = model(torch.tensor([tokens]))[0]
            diff = (swarm - monolith).abs().max().item()
            print(
                f"chain of 4 node processes vs monolith, fp32: max abs logit diff {diff:.3g} over {len(tokens)} tokens"
            )
            assert diff < TOL
            greedy = model.generate(prompt, 24)
            assert tokens[len(prompt) : len(prompt) + len(greedy)] == greedy[:24]
            # speculative: 5 drafts in one trip, 2 accepted, then verify 3 from the rolled-back start
            drafts = [7, 7, 9, 11, 13]
            await through(hops, "gen", held, model.stem(torch.tensor([drafts])))
            verify = [30, 31, 32]
            x, after = await through(hops, "gen", held + 2, model.stem(torch.tensor([verify])))
            accepted = tokens + drafts[:2] + verify
            assert after == len(accepted)
            fresh = model(torch.tensor([accepted]))[0, -3:]
            rollback = (model.head(x)[0] - fresh).abs().max().item()
            print(f"verify after a rollback vs a fresh monolith forward: max abs logit diff {rollback:.3g}")
            assert rollback < TOL
    finally:
        for hop in hops:
            await hop.close()
        for c in channels:
            await c.close()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    for line in (await client.get(url)).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


async def settled_rss(pid: int, client: httpx.AsyncClient, url: str) -> int:
    """The node's RSS once it holds no stream (the idle sweep has run), the lowest of a few readings."""
    deadline = time.monotonic() + 20
    while await metric(client, url, "layerswarm_node_streams_open") > 0:
        assert time.monotonic() < deadline, "streams were not freed"
        await asyncio.sleep(0.2)
    readings = []
    for _ in range(5):
        await asyncio.sleep(0.2)
        readings.append(rss_kib(pid))
    return min(readings)


async def run_streams(stub: pb_grpc.BlockNodeStub, first: int, count: int, dim: int) -> None:
    """`count` streams, eight at a time, ended four ways in turn: the release flag on the last step, a
    Release call, the end of the DecodeStream they were opened over, and abandoned (the idle timeout)."""

    async def one(i: int) -> None:
        prompt = torch.randn(1, 100, dim)
        sid = f"m{i}"
        mode = i % 4
        if mode == 2:
            requests = [
                decode_request(sid, 0, prompt),
                *(decode_request(sid, 100 + s, torch.randn(1, 1, dim)) for s in range(3)),
            ]
            replies = [r async for r in stub.DecodeStream(iter(requests))]
            assert [r.length for r in replies] == [100, 101, 102, 103]
            return
        await stub.Decode(decode_request(sid, 0, prompt))
        for s in range(3):
            await stub.Decode(decode_request(sid, 100 + s, torch.randn(1, 1, dim), release=mode == 0 and s == 2))
        if mode == 1:
            assert (await stub.Release(pb.ReleaseRequest(stream_ids=[sid]))).released == 1

    for batch in range(first, first + count, 8):
        await asyncio.gather(*(one(i) for i in range(batch, min(batch + 8, first + count))))


async def test_a_node_gives_its_memory_back_after_a_thousand_streams(tmp_path: Path) -> None:
    """RSS of a real node process (from /proc) after 1,000 streams, each holding 100+ tokens of a cache
    of 1 KiB a token (128 KiB a stream: a leak of 1,000 would be 128 MiB), ended in four ways: back
    within 5% of the same node's RSS when idle (holding no stream) after a warm-up of 200 such streams.
    The node gives freed heap pages back to the kernel when it holds none (node/decode.py)."""
    dim = 128
    path = tmp_path / "model"
    make_lm_dir(path, seed=4, dim=dim, depth=2, heads=4, kv_heads=4, max_seq_len=256)
    port = free_port()
    (node,) = start_nodes([(path, 0)], "--metrics-port", str(port), "--idle-timeout", "1")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with httpx.AsyncClient() as client, grpc.aio.insecure_channel(node_address(node)) as channel:
            stub = pb_grpc.BlockNodeStub(channel)
            started = time.monotonic()
            await run_streams(stub, 0, WARM_UP, dim)  # torch, gRPC and the allocator reach their working set
            idle = await settled_rss(node.pid, client, url)
            await run_streams(stub, WARM_UP, 1000, dim)
            steps = await metric(client, url, 'layerswarm_node_decode_steps_total{kind="step"}')
            after = await settled_rss(node.pid, client, url)
            assert await metric(client, url, "layerswarm_node_cache_bytes") == 0
            print(
                f"node RSS idle after warm-up {idle / 1024:.1f} MiB, after 1,000 more streams {after / 1024:.1f} MiB "
                f"({(after / idle - 1) * 100:+.2f}%), {time.monotonic() - started:.0f} s"
            )
            assert steps == 3 * (WARM_UP + 1000)
            assert after <= idle * 1.05
    finally:
        stop_all([node])


def test_a_tampered_decoder_block_stops_the_node_from_starting(tmp_path: Path) -> None:
    path = tmp_path / "model"
    make_lm_dir(path, depth=2)
    block = path / block_file(1)
    data = bytearray(block.read_bytes())
    data[len(data) // 2] ^= 0x01
    block.write_bytes(bytes(data))
    result = subprocess.run(
        layerswarm_cmd("node", "--model-dir", str(path), "--block", "1", "--no-advertise"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "sha256" in result.stderr and "tampered" in result.stderr and "Traceback" not in result.stderr
