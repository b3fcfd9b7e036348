"""One node's hop at ViT-B/16 shape against the raw TCP floor and a bare gRPC echo of the same bytes,
with the echo's rungs (grpc_echo.py) splitting the difference into protobuf, codec and checks, the
compute hand-off and the rest of the node."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from layerswarm.coordinator import NodeClient
from layerswarm.harness.procs import Proc
from layerswarm.models.checkpoint import load_model
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

from .fixtures import median_ms
from .grpc_echo import HOP_PARTS, RUNGS, GrpcEcho
from .tcp_floor import EchoServer


async def hop_vs_floor(model_dir: Path, node: Proc, reps: int) -> list[dict[str, Any]]:
    """One node's round trip minus its compute time, against a bare gRPC echo and raw TCP echoing the
    same bytes, and the echo's rungs (grpc_echo.py); samples are interleaved, so the machine's drift hits
    them all alike. node / echo is our share, split by the rungs into protobuf, codec and checks, the
    compute hand-off and the rest of the node; echo / floor is gRPC's."""
    model, _ = load_model(model_dir)
    tokens, dim = model.cfg.num_tokens, model.cfg.dim
    address = f"127.0.0.1:{node.ready['port']}"
    transports = ("unary", "stream")
    clients = {t: NodeClient(address, 64 * 1024 * 1024, t) for t in transports}
    rows = []
    with EchoServer() as echo:
        async with GrpcEcho() as grpc_echo:
            for batch, dtype in ((1, torch.float16), (1, torch.float32), (8, torch.float32)):
                x = torch.randn(batch, tokens, dim).to(dtype)
                request = pb.ForwardRequest(request_id="bench", activations=codec.encode(x), position=0)
                nbytes = len(request.activations.data)
                payload = bytes(nbytes)
                samples: dict[str, list[float]] = {"tcp_floor": []}
                for i in range(reps + 2):
                    floor = echo.round_trip(nbytes)
                    for transport, client in clients.items():
                        echoed = await grpc_echo.round_trip(payload, transport)
                        started = time.perf_counter()
                        reply = await client.forward(request, timeout=60)
                        overhead = time.perf_counter() - started - reply.compute_ms / 1e3
                        if i >= 2:
                            samples.setdefault(f"{transport}_overhead", []).append(overhead)
                            samples.setdefault(f"grpc_echo_{transport}", []).append(echoed)
                    rungs = {rung: (await grpc_echo.rung_trip(rung, request))[0] for rung in RUNGS[1:]}
                    if i >= 2:
                        samples["tcp_floor"].append(floor)
                        for rung, elapsed in rungs.items():
                            samples.setdefault(f"rung_{rung}", []).append(elapsed)
                rows.append(_hop_row(nbytes, [batch, tokens, dim], dtype, samples, transports))
    for client in clients.values():
        await client.close()
    return rows


def _hop_row(
    nbytes: int, shape: list[int], dtype: torch.dtype, samples: dict[str, list[float]], transports: tuple[str, ...]
) -> dict[str, Any]:
    row: dict[str, Any] = {"payload_bytes": nbytes, "shape": shape, "dtype": str(dtype)[6:]}
    row.update({f"{k}_ms": median_ms(v) for k, v in samples.items()})
    for t in transports:
        row[f"{t}_over_floor"] = round(row[f"{t}_overhead_ms"] / row["tcp_floor_ms"], 3)
        row[f"grpc_echo_{t}_over_floor"] = round(row[f"grpc_echo_{t}_ms"] / row["tcp_floor_ms"], 3)
        row[f"{t}_over_grpc_echo"] = round(row[f"{t}_overhead_ms"] / row[f"grpc_echo_{t}_ms"], 3)
    # Each part's share of a streamed hop: the difference between consecutive rungs (grpc_echo.py).
    ladder = [row["grpc_echo_stream_ms"], *(row[f"rung_{r}_ms"] for r in RUNGS[1:]), row["stream_overhead_ms"]]
    row["stream_parts_ms"] = {p: round(b - a, 3) for p, a, b in zip(HOP_PARTS, ladder[:-1], ladder[1:], strict=True)}
    return row
