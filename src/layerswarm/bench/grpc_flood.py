"""A tokenless gRPC flood on one node: `python -m layerswarm.bench.grpc_flood [--connections 16]
[--seconds 60] [--json FILE]`.

One node (the shipped family's block 0, with a swarm token) on 127.0.0.1; a legit client that signs its
Forward calls as a coordinator does (batch 1); and a flood from another process, bounded in time: N
connections, each with 4 max-size unary Forward calls at a time without credentials, 4 ForwardStream
streams that send a max-size first message and hold, and 2 health checks padded to the node's receive
limit (open methods read what they are sent). Phases, in one run: the legit client alone (its p50, the
node's RSS), under the flood (its p50 and every failure, the node's RSS sampled every 0.5 s: the
peak), and after it (the node's RSS once the flood has been gone for `--settle` seconds). The figures are
ratios and differences against the same run's first phase.

The flood runs only against 127.0.0.1 and stops by itself (`--seconds`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2

from layerswarm.harness.procs import Proc, node_cmd, spawn, stop_all
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.zoo import family_root
from layerswarm.node.server import receive_limit
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.auth import NONCE_KEY, CallSigner, info_identity
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from . import emit_report
from .machine import environment

log = logging.getLogger(__name__)
FORWARD = "/layerswarm.v1.BlockNode/Forward"
FORWARD_STREAM = "/layerswarm.v1.BlockNode/ForwardStream"
HEALTH = "/grpc.health.v1.Health/Check"
TOKEN = "grpc-flood-bench-token"
UNARY, STREAMS, HEALTH_CALLS = 4, 4, 2  # per flooding connection, at a time
KINDS = ("unary", "streams", "health")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


# --- the flood (its own process: `python -m layerswarm.bench.grpc_flood --flood TARGET ...`) ------------


async def flood(
    target: str, connections: int, seconds: float, size: int, kinds: tuple[str, ...] = KINDS
) -> dict[str, Any]:
    """Every connection's calls, back to back until `seconds` are over; outcomes by status code."""
    payload = pb.ForwardRequest(activations=pb.Tensor(data=b"\0" * size), position=0).SerializeToString()
    padded = health_pb2.HealthCheckRequest(service="x" * size).SerializeToString()
    outcomes: Counter[str] = Counter()
    deadline = time.monotonic() + seconds

    async def loop(call: Callable[[], Awaitable[None]]) -> None:
        while time.monotonic() < deadline:
            try:
                await call()
                outcomes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                outcomes[exc.code().name] += 1
            except asyncio.TimeoutError:
                outcomes["timeout"] += 1

    # A channel each, not sharing one connection (a local subchannel pool per channel).
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", size + 1024)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(connections)]
    tasks = []
    for channel in channels:
        forward = channel.unary_unary(FORWARD)
        stream = channel.stream_stream(FORWARD_STREAM)
        health = channel.unary_unary(HEALTH)

        async def unary(forward: Any = forward) -> None:
            await forward(payload, timeout=10)

        async def held(stream: Any = stream) -> None:
            call = stream(timeout=max(0.1, deadline - time.monotonic()))
            await call.write(payload)
            while await call.read() is not grpc.aio.EOF:  # held until the node ends it (or the flood is over)
                pass

        async def checked(health: Any = health) -> None:
            await health(padded, timeout=10)

        tasks += [loop(unary) for _ in range(UNARY if "unary" in kinds else 0)]
        tasks += [loop(held) for _ in range(STREAMS if "streams" in kinds else 0)]
        tasks += [loop(checked) for _ in range(HEALTH_CALLS if "health" in kinds else 0)]
    await asyncio.gather(*tasks)
    for channel in channels:
        await channel.close()
    return {
        "connections": connections,
        "seconds": seconds,
        "message_bytes": size,
        "kinds": list(kinds),
        "outcomes": dict(outcomes),
    }


# --- the legit client and the phases -------------------------------------------------------------------


class Legit:
    """Signed batch-1 Forward calls, one at a time, as a coordinator sends them."""

    def __init__(self, target: str, tokens: int, dim: int) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.BlockNodeStub(self.channel)  # type: ignore[no-untyped-call]
        self.signer = CallSigner(TOKEN)
        self.request = pb.ForwardRequest(activations=codec.encode(torch.randn(1, tokens, dim)), position=0)

    async def prove(self) -> None:
        nonce = self.signer.new_nonce()
        call = self.stub.Info(pb.InfoRequest(), metadata=((NONCE_KEY, nonce),), timeout=10)
        reply = await call
        if not self.signer.accept_info(await call.trailing_metadata(), nonce, info_identity(reply)):
            raise RuntimeError("the node did not prove the bench's token")

    async def run(self, seconds: float, pid: int) -> dict[str, Any]:
        latencies: list[float] = []
        failures: Counter[str] = Counter()
        peak = 0.0
        end = time.monotonic() + seconds
        next_sample = 0.0
        while time.monotonic() < end:
            started = time.perf_counter()
            try:
                await self.stub.Forward(self.request, timeout=10, metadata=(self.signer.sign(FORWARD),))
                latencies.append((time.perf_counter() - started) * 1e3)
            except grpc.aio.AioRpcError as exc:
                failures[exc.code().name] += 1
            if time.monotonic() >= next_sample:
                peak, next_sample = max(peak, rss_mib(pid)), time.monotonic() + 0.5
            await asyncio.sleep(0.01)
        return {
            "requests": len(latencies) + sum(failures.values()),
            "failed": dict(failures),
            "p50_ms": round(statistics.median(latencies), 3) if latencies else None,
            "p95_ms": round(statistics.quantiles(latencies, n=20)[18], 3) if len(latencies) >= 20 else None,
            "node_rss_peak_mib": round(peak, 1),
        }


async def measure(
    node: Proc, connections: int, seconds: float, alone_s: float, settle_s: float, kinds: tuple[str, ...] = KINDS
) -> dict[str, Any]:
    manifest = read_manifest(family_root() / "layershuffle-0")
    cfg = manifest.config
    size = receive_limit(NodeSettings(model_dir=family_root() / "layershuffle-0", block=0), cfg) - 64
    target = f"127.0.0.1:{node.ready['port']}"
    pid = node.popen.pid
    legit = Legit(target, cfg.num_tokens, cfg.dim)
    await legit.prove()
    await legit.run(3.0, pid)  # warm: the first calls pay for imports and allocations
    rss_before = rss_mib(pid)
    alone = await legit.run(alone_s, pid)
    argv = ["--flood", target, "--connections", str(connections), "--seconds", str(seconds), "--size", str(size)]
    argv += ["--kinds", ",".join(kinds)]
    flooder = subprocess.Popen(
        [sys.executable, "-m", "layerswarm.bench.grpc_flood", *argv], stdout=subprocess.PIPE, text=True
    )
    try:
        await asyncio.sleep(1.0)  # the flood's connections open
        under = await legit.run(max(1.0, seconds - 2.0), pid)
        out, _ = await asyncio.to_thread(flooder.communicate, timeout=seconds + 60)
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait(5)
    await asyncio.sleep(settle_s)
    rss_after = rss_mib(pid)
    after = await legit.run(alone_s / 2, pid)
    await legit.channel.close()
    ratio = under["p50_ms"] / alone["p50_ms"] if under["p50_ms"] and alone["p50_ms"] else None
    return {
        "flood": json.loads(out),
        "legit_alone": alone,
        "legit_under_flood": under,
        "legit_after": after,
        "p50_ratio": round(ratio, 3) if ratio else None,
        "legit_failed_under_flood": sum(under["failed"].values()),
        "node_rss_before_mib": round(rss_before, 1),
        "node_rss_peak_mib": under["node_rss_peak_mib"],
        "node_rss_growth_peak_mib": round(under["node_rss_peak_mib"] - rss_before, 1),
        "node_rss_after_mib": round(rss_after, 1),
        "node_rss_growth_after_mib": round(rss_after - rss_before, 1),
        "settle_s": settle_s,
    }


def run(
    connections: int, seconds: float, alone_s: float, settle_s: float, kinds: tuple[str, ...] = KINDS
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        token = Path(tmp) / "token"
        token.write_text(TOKEN)
        cmd = node_cmd(family_root() / "layershuffle-0", 0, "--no-advertise", "--grace", "0.2", f"--token-file={token}")
        node = spawn("node", cmd)
        try:
            result = asyncio.run(measure(node, connections, seconds, alone_s, settle_s, kinds))
        finally:
            stop_all([node])
    return {"environment": environment(), **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerswarm.bench.grpc_flood", description=__doc__.split("\n")[0])
    p.add_argument("--connections", type=int, default=16, help="flooding connections")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the flood lasts")
    p.add_argument("--alone", type=float, default=20.0, help="seconds of legit traffic alone (the baseline)")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after the flood before RSS is read")
    p.add_argument("--kinds", default=",".join(KINDS), help="what the flood sends (comma-separated: %(default)s)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--flood", metavar="TARGET", help=argparse.SUPPRESS)  # the flooding process itself
    p.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    if not set(kinds) <= set(KINDS):
        p.error(f"--kinds {args.kinds}: choose from {', '.join(KINDS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.flood:
        if not args.flood.startswith("127.0.0.1:"):
            p.error("--flood: loopback targets only")
        report = asyncio.run(flood(args.flood, args.connections, args.seconds, args.size, kinds))
        print(json.dumps(report), flush=True)
        return 0
    torch.set_num_threads(1)
    return emit_report(run(args.connections, args.seconds, args.alone, args.settle, kinds), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
