"""bench/grpc_echo.py: every rung of the hop ladder answers what a node would, so the differences
between rungs are the costs of real steps (not of a rung that skipped its work or broke the data)."""

from __future__ import annotations

import torch

from layerswarm.bench.grpc_echo import RUNGS, GrpcEcho
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb


async def test_each_rung_returns_the_activations_it_was_sent() -> None:
    x = torch.randn(1, 197, 768)
    async with GrpcEcho() as echo:
        assert await echo.round_trip(bytes(1000), "stream") > 0
        assert await echo.round_trip(bytes(1000), "unary") > 0
        for dtype in (torch.float16, torch.float32):
            request = pb.ForwardRequest(request_id="r", activations=codec.encode(x, dtype))
            for rung in RUNGS[1:]:
                seconds, reply = await echo.rung_trip(rung, request)
                assert seconds > 0
                assert reply.request_id == "r"
                assert torch.equal(codec.decode(reply.activations), codec.decode(request.activations)), rung
