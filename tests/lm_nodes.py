"""Helpers for the decoder node tests: tiny random decoder model directories, a local reference stream
(the block itself with a KV cache, as DecoderLM runs it), and Decode calls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch

from layerswarm.models.checkpoint import Lineage, save_model
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.model import DecoderBlock, DecoderLM
from layerswarm.models.lm.tokenizer import TOKENIZER_FILE
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

TINY_LM = {"vocab_size": 97, "dim": 32, "depth": 3, "heads": 4, "kv_heads": 2, "max_seq_len": 64}
TOL = 1e-5  # fp32 on the wire: the node computes exactly what the block computes locally (measured: 0 to 1e-7)


def make_lm_dir(path: Path, seed: int = 0, **overrides: object) -> DecoderLM:
    """A decoder model directory with random weights (and a placeholder tokenizer: nodes never read it)."""
    torch.manual_seed(seed)
    model = DecoderLM(LMConfig(**{**TINY_LM, **overrides})).eval()  # type: ignore[arg-type]
    path.mkdir(parents=True, exist_ok=True)
    (path / TOKENIZER_FILE).write_text(json.dumps({"note": "test placeholder"}))
    save_model(model, path, Lineage(source="scratch"))
    return model


class LocalStream:
    """The reference: one stream through a local copy of the block, cached as a node caches it."""

    def __init__(self, block: DecoderBlock) -> None:
        self.block, self.cache = block, block.new_cache()

    @torch.inference_mode()
    def step(self, x: torch.Tensor, start: int | None = None) -> torch.Tensor:
        if start is not None and start < self.cache.length:
            self.cache.truncate(start)
        return self.block(x, caches=[self.cache])

    @torch.inference_mode()
    def fill(self, x: torch.Tensor) -> None:
        self.block.append_kv(x, [self.cache])


def decode_request(stream_id: str, start: int, x: torch.Tensor, **kw: object) -> pb.DecodeRequest:
    return pb.DecodeRequest(stream_id=stream_id, start=start, activations=codec.encode(x), **kw)  # type: ignore[arg-type]


def out_of(reply: pb.DecodeResponse) -> torch.Tensor:
    return codec.decode(reply.activations)


async def refusal(call: object) -> grpc.aio.AioRpcError:
    """The error an awaited call ends with (the test fails if it succeeds)."""
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded; a refusal was expected")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def proxy_from(source: str, target_port: int) -> AsyncIterator[int]:
    """A TCP proxy on 127.0.0.1 that dials 127.0.0.1:target_port from the address `source` (another
    loopback address): the node sees a caller on another host. Yields the proxy's port; ends its
    connections when the block exits."""
    tasks: set[asyncio.Task[None]] = set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        node_r, node_w = await asyncio.open_connection("127.0.0.1", target_port, local_addr=(source, 0))
        for task in (asyncio.create_task(pipe(client_r, node_w)), asyncio.create_task(pipe(node_r, client_w))):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
