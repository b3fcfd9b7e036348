"""`layerswarm chaos` modes: the attack run (default), --basic (faults only), --soak; each writes its
report as JSON on request, prints it, and exits 0 only when its targets hold."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any


def run_from_args(args: argparse.Namespace) -> int:
    if args.soak:
        return _soak(args)
    if args.basic:
        return _basic(args)
    return _attack(args)


def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def _attack(args: argparse.Namespace) -> int:
    from .attack import AttackOptions, quick_options, render_attack, run_attack

    opts = quick_options(args.seed) if args.quick else AttackOptions(seed=args.seed, hold_s=args.hold)
    if args.requests is not None:
        opts.requests = args.requests
    opts.concurrency = args.concurrency if not args.quick else opts.concurrency
    report = run_attack(opts)
    _write(args, report)
    print(render_attack(report))
    return 0 if all(row["pass"] for row in report["checks"]) else 1


def _basic(args: argparse.Namespace) -> int:
    from .options import QUICK, ChaosOptions
    from .report import render
    from .run import run_chaos

    requests = ChaosOptions.requests if args.requests is None else args.requests
    opts = ChaosOptions(requests=requests, concurrency=args.concurrency, seed=args.seed, hold_s=args.hold)
    if args.quick:
        opts = dataclasses.replace(QUICK, seed=args.seed)
    report = run_chaos(opts)
    _write(args, report)
    print(render(report))
    return 0 if report["lost"] == 0 and report["non_200_while_min_depth_reachable"] == 0 else 1


def _soak(args: argparse.Namespace) -> int:
    from .soak import SoakOptions, render_soak, run_soak

    if args.duration <= 0:
        print("layerswarm chaos: error: --duration must be positive", file=sys.stderr)
        return 2
    report = run_soak(SoakOptions(duration_s=args.duration, seed=args.seed))
    _write(args, report)
    print(render_soak(report))
    return 0 if report["lost"] == 0 and report["non_200_while_min_depth_reachable"] == 0 else 1
