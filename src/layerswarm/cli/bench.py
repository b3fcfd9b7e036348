"""`layerswarm bench`: the benchmark suite (swarm vs monolith, hop vs TCP, wire formats, concurrency)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .base import Subparsers, UsageError, add_command


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "bench",
        run,
        help="the benchmark suite: swarm vs monolith, hop vs TCP, wire, concurrency",
        description="Measure the swarm against a monolith and raw TCP in one run; JSON and markdown out. "
        "--quick finishes in a few minutes.",
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions (CI runs this)")
    p.add_argument("--json", type=Path, help="write the report as JSON here")
    p.add_argument("--markdown", type=Path, help="write the tables as markdown here")
    p.add_argument(
        "--only",
        choices=[
            "adaptive",
            "exit-default",
            "anytime-default",
            "edge-lan",
            "wire",
            "hop",
            "vitb",
            "process-ring",
            "cuda",
            "decode-node",
            "load-balancer",
            "generation",
            "generation-modes",
            "token-time",
        ],
        help="run one suite alone (adaptive compute; exit-default: each shipped family (shapes, text) with "
        "default options through a swarm against itself at full depth, 500 requests each, and eval's "
        "calibration on the same requests; anytime-default: each shipped family with only deadline_ms set, "
        "over deadlines from 0.25x to 1.5x the full path's p50 (the accuracy curve of anytime answers); "
        "vitb: the ViT-B/16-shaped swarm against the monolith, "
        "latency, throughput, hop, coordinator CPU and the process ring; "
        "edge-lan: star vs relay on a shaped LAN of namespaces; "
        "wire: accuracy, bytes and latency of each wire format through a swarm of the shipped family; "
        "hop: one ViT-B/16-shaped hop against a bare gRPC echo and raw TCP; "
        "process-ring: the blocks in a process each, passed over pipes, against one process's loop; "
        "cuda: the vitb latency, throughput and hop with 12 CUDA nodes on one GPU, against the monolith there; "
        "decode-node: one decoder node, a stream's steps against 16 concurrent streams' throughput; "
        "load-balancer: a classification through HAProxy in front of two coordinators against direct; "
        "generation: the shipped decoder through a swarm, batch-1 per-token latency against the route's "
        "floor and 16 streams' tokens/s against one's; generation-modes: plain decoding, speculation (k=2, "
        "auto) and per-token early exit through one swarm of the exit-aware decoder, same prompts; token-time: "
        "where a batch-1 token's time goes through that swarm, rung by rung: gRPC echo, one node's hop, the "
        "chain of nodes, the coordinator in-process, HTTP)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from layerswarm.bench.runner import main as bench_main

    if args.only == "cuda" and not torch.cuda.is_available():
        raise UsageError("--only cuda: torch sees no CUDA GPU on this machine (the other suites run on the CPU)")

    return bench_main(args.quick, args.json, args.markdown, args.only)
