"""`layerswarm chaos`: load plus seeded faults on a one-host-per-node swarm, then a report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from layerswarm.chaos.options import QUICK, ChaosOptions

from .base import Subparsers, add_command, positive_int


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "chaos",
        run,
        help="failure injection: load plus faults on a one-host-per-node swarm, a report",
        description="Every node its own host (network namespace on a bridge), discovering over mDNS; a bounded "
        "load generator; faults on a seeded schedule (kill, freeze, pulled cable, dropped packets, netem delay "
        "where the kernel has it, slow and malformed nodes, restarts, joins, coordinator restart). Needs root; "
        "runs in a private namespace.",
    )
    p.add_argument("--requests", type=positive_int, default=ChaosOptions.requests, help="requests to send")
    p.add_argument("--concurrency", type=positive_int, default=ChaosOptions.concurrency, help="concurrent clients")
    p.add_argument("--hold", type=float, default=ChaosOptions.hold_s, help="seconds each fault lasts")
    p.add_argument("--seed", type=int, default=ChaosOptions.seed, help="seed of the fault schedule")
    p.add_argument("--quick", action="store_true", help=f"{QUICK.requests} requests, shorter faults (CI)")
    p.add_argument("--json", type=Path, help="write the report as JSON here")


def run(args: argparse.Namespace) -> int:
    from layerswarm.harness import netns

    if not netns.in_private_netns():
        if os.geteuid() != 0 or not netns.can_unshare():
            print("layerswarm chaos: error: needs root and `unshare` (it builds network namespaces)", file=sys.stderr)
            return 2
        return netns.reexec_in_private_netns(args.argv)
    from layerswarm.chaos.report import render
    from layerswarm.chaos.run import run_chaos

    opts = ChaosOptions(requests=args.requests, concurrency=args.concurrency, seed=args.seed, hold_s=args.hold)
    if args.quick:
        opts = dataclasses.replace(QUICK, seed=args.seed)
    report = run_chaos(opts)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    return 0 if report["lost"] == 0 and report["non_200_while_min_depth_reachable"] == 0 else 1
