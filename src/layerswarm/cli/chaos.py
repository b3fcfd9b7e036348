"""`layerswarm chaos`: load plus seeded faults on a one-host-per-node swarm, then a report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from layerswarm.chaos.options import ChaosOptions

from .base import Subparsers, add_command, positive_int


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "chaos",
        run,
        help="failure injection: load plus faults on a one-host-per-node swarm, a report",
        description="Every node its own host (network namespace on a bridge), discovering over mDNS; a bounded "
        "load generator; faults on a seeded schedule (kill, freeze, pulled cable, dropped packets, netem delay "
        "where the kernel has it, slow and malformed nodes, restarts, joins, coordinator restart), with rogue "
        "nodes and a forging device (forged mDNS goodbyes and adverts, token theft) on a token-protected swarm; "
        "a report with pass/fail per target. --soak: continuous churn for --duration. --family lm: the same "
        "for streamed generation (docs/chaos.md). Needs root; runs in a private namespace.",
    )
    p.add_argument(
        "--family",
        choices=("shapes", "lm"),
        default="shapes",
        help="shapes: classification load (the runs above); lm: the shipped language-model family, streamed "
        "greedy completions (POST /v1/completions, stream: true) of held-out task prompts, first without faults, "
        "then again while faults land mid-stream (a turncoat and a liar redeployed as lying decoder nodes, "
        "SIGKILL, SIGSTOP, a restart, a third of the nodes SIGKILLed at once); verdicts: every stream [DONE], "
        "the liars convicted and the streams they touched rebuilt, no honest node convicted, rebuilds and "
        "skips counted, exact match within 2 points of the no-fault run. --requests: streams with faults "
        "(default 400; --quick 48), --concurrency: streams at once, --hold: seconds a kill or freeze lasts",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        help=f"requests to send (default: 5000; with --basic: {ChaosOptions.requests})",
    )
    p.add_argument("--concurrency", type=positive_int, default=ChaosOptions.concurrency, help="concurrent clients")
    p.add_argument("--hold", type=float, default=ChaosOptions.hold_s, help="seconds each fault lasts")
    p.add_argument("--seed", type=int, default=ChaosOptions.seed, help="seed of the fault schedule")
    p.add_argument("--quick", action="store_true", help="a short variant: fewer requests, shorter faults (CI)")
    p.add_argument(
        "--basic", action="store_true", help="the failure schedule alone (no rogue nodes, no forging device, no token)"
    )
    p.add_argument("--json", type=Path, help="write the report as JSON here")
    p.add_argument(
        "--soak",
        action="store_true",
        help="continuous churn (faults, rogues, joins, forged adverts) for --duration seconds; samples each "
        "coordinator's memory, heap and open files every minute and fails if RSS or open files grow more than "
        "3%% after minute 5 (nodes: start and end)",
    )
    p.add_argument("--duration", type=float, default=1800.0, help="soak length in seconds (default: %(default)s)")
    p.add_argument(
        "--coordinators",
        type=int,
        choices=(1, 2, 3),
        default=1,
        help="coordinators, each told of the others (--coordinator-peer): the load goes through the Python "
        "client with all their URLs (one attempt per coordinator per request), and every coordinator is "
        "SIGKILLed and restarted in turn; the report adds 0 5xx, kills and liar avoidance (the attack run "
        "only)",
    )


def run(args: argparse.Namespace) -> int:
    from layerswarm.harness import netns

    if not netns.in_private_netns():
        if os.geteuid() != 0 or not netns.can_unshare():
            print("layerswarm chaos: error: needs root and `unshare` (it builds network namespaces)", file=sys.stderr)
            return 2
        return netns.reexec_in_private_netns(args.argv)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    if args.family == "lm":
        return _lm(args)
    if args.coordinators > 1 and (args.soak or args.basic):
        print(
            "layerswarm chaos: error: --coordinators above 1 runs with the attack run only (not --basic or --soak): "
            "the coordinators' tips are signed with its swarm token",
            file=sys.stderr,
        )
        return 2
    if args.soak:
        return _soak(args)
    if args.basic:
        return _basic(args)
    return _attack(args)


def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def _attack(args: argparse.Namespace) -> int:
    from layerswarm.chaos.attack import AttackOptions, quick_options, render_attack, run_attack

    opts = (
        quick_options(args.seed, args.coordinators)
        if args.quick
        else AttackOptions(seed=args.seed, hold_s=args.hold, coordinators=args.coordinators)
    )
    if args.requests is not None:
        opts.requests = args.requests
    opts.concurrency = args.concurrency if not args.quick else opts.concurrency
    report = run_attack(opts)
    _write(args, report)
    print(render_attack(report))
    return 0 if all(row["pass"] for row in report["checks"]) else 1


def _basic(args: argparse.Namespace) -> int:
    from layerswarm.chaos.options import QUICK
    from layerswarm.chaos.report import render
    from layerswarm.chaos.run import run_chaos

    requests = ChaosOptions.requests if args.requests is None else args.requests
    opts = ChaosOptions(requests=requests, concurrency=args.concurrency, seed=args.seed, hold_s=args.hold)
    if args.quick:
        opts = dataclasses.replace(QUICK, seed=args.seed)
    report = run_chaos(opts)
    _write(args, report)
    print(render(report))
    return 0 if report["lost"] == 0 and report["non_200_while_min_depth_reachable"] == 0 else 1


def _lm(args: argparse.Namespace) -> int:
    from layerswarm.chaos.lm_report import render_lm
    from layerswarm.chaos.lm_run import QUICK, LMChaosOptions, run_lm_chaos

    if args.soak or args.basic or args.coordinators > 1:
        print(
            "layerswarm chaos: error: --family lm runs its own schedule (liars and faults mid-stream): not with "
            "--soak, --basic or --coordinators",
            file=sys.stderr,
        )
        return 2
    opts = dataclasses.replace(QUICK) if args.quick else LMChaosOptions(hold_s=args.hold)
    opts.seed = args.seed
    if args.requests is not None:
        opts.streams = args.requests
    if not args.quick:
        opts.concurrency = args.concurrency
    report = run_lm_chaos(opts)
    _write(args, report)
    print(render_lm(report))
    return 0 if all(row["pass"] for row in report["checks"]) else 1


def _soak(args: argparse.Namespace) -> int:
    from layerswarm.chaos.soak import SoakOptions, render_soak, run_soak, stayed_flat

    if args.duration <= 0:
        print("layerswarm chaos: error: --duration must be positive", file=sys.stderr)
        return 2
    report = run_soak(SoakOptions(duration_s=args.duration, seed=args.seed))
    _write(args, report)
    print(render_soak(report))
    ok = report["lost"] == 0 and report["non_200_while_min_depth_reachable"] == 0 and stayed_flat(report)
    return 0 if ok else 1
