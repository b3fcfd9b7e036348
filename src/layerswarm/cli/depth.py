"""`layerswarm depth`: per-token depth tables for a text model, and what they cost in accuracy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .base import Subparsers, add_command, int_at_least


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "depth",
        run,
        help="per-token depth for text models (mutual information, reconstruction)",
        description="Estimate each word's depth from the model's training data (MI: log-scaled, N equal-width "
        "bins, smoothing 0.1; reconstruction: an anytime masked LM fine-tuned from the model, "
        "argmin_n(loss_n + 0.1 n)), write the tables into each model "
        "directory's policy, and evaluate accuracy and mean depth per token against full depth.",
    )
    p.add_argument("model_dirs", nargs="+", type=Path, help="text model directories")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--orders", type=int_at_least(1), default=5, help="random block orders for the arbitrary figure")
    p.add_argument("--sentences", type=int_at_least(10), default=1000, help="sentences for the reconstruction estimate")
    p.add_argument(
        "--mlm-steps",
        type=int_at_least(1),
        default=400,
        help="fine-tuning steps (batch 128) of the anytime masked LM behind the reconstruction estimate",
    )
    p.add_argument(
        "--swarm",
        type=int_at_least(1),
        default=0,
        help="then run N test sentences at batch 1 through a loopback swarm of the first model (node processes): "
        "tokens, bytes, latency per request vs full depth",
    )
    p.add_argument("--no-write", action="store_true", help="evaluate only, leave the model directories as they are")
    p.add_argument(
        "--policy-out",
        type=Path,
        metavar="DIR",
        help="write the depth tables into copies of the model directories under DIR (needed for shipped "
        "models, which are never written: they belong to the installed package)",
    )
    p.add_argument(
        "--limit",
        type=int_at_least(10),
        help="evaluate on the first N test sentences only (default: all)",
    )
    p.add_argument(
        "--existing",
        action="store_true",
        help="evaluate the tables already in each model's policy (e.g. those `train --token-depth` trained with) "
        "instead of estimating new ones",
    )


def run(args: argparse.Namespace) -> int:
    from layerswarm.training.text.runs import DepthJob, NotATextModel, estimate_depths

    from .model_dirs import policy_targets

    model_dirs = args.model_dirs
    if not args.no_write and not args.existing:
        model_dirs = policy_targets(model_dirs, args.policy_out, no_write_flag="--no-write")
    job = DepthJob(
        model_dirs=tuple(model_dirs),
        orders=args.orders,
        sentences=args.sentences,
        mlm_steps=args.mlm_steps,
        write=not args.no_write,
        limit=args.limit,
        existing=args.existing,
    )
    try:
        report = estimate_depths(job, on_model=lambda name, row: print(json.dumps({name: row["results"]})))
    except NotATextModel as exc:
        raise SystemExit(f"layerswarm depth: {exc}") from None
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.swarm:
        from layerswarm.bench.text_depth import run_swarm_bench

        swarm = run_swarm_bench(model_dirs[0], args.swarm)
        print(json.dumps({"swarm": swarm}, indent=1))
        if args.json:
            report_with_swarm = {**json.loads(args.json.read_text()), "swarm": swarm}
            args.json.write_text(json.dumps(report_with_swarm, indent=2) + "\n")
    return 0
