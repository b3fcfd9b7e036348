"""`layerswarm family`: fine-tune K members from one base model (a mergeable family)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerswarm.models.config import VARIANTS

from . import lm
from .base import (
    Subparsers,
    add_command,
    folder,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability_below_one,
)
from .train import data_spec


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "family",
        run,
        help="fine-tune K members from one base: a mergeable family",
        description="Fine-tune K models from one base model with different seeds. Members share the base's "
        "family id, so their blocks can be mixed.",
    )
    p.add_argument("--base", required=True, type=Path, help="model directory every member is fine-tuned from")
    p.add_argument("--members", type=positive_int, default=4, help="how many members")
    p.add_argument("--out", required=True, type=folder, help="folder for the members (OUT/<prefix>-<i>)")
    p.add_argument("--prefix", default="member", help="member directory prefix")
    p.add_argument("--overwrite", action="store_true", help="replace members already in OUT (refused without it)")
    p.add_argument("--variant", choices=VARIANTS, default="layershuffle", help="training approach")
    # 10 passes at 1e-3 rather than 5 at 5e-4: members that drift further from the base err differently, and
    # their ensemble then beats the best member beyond a 5,000-image test set's noise on relations and
    # counting while merging still keeps >= 0.99 (docs/own-data.md, 2026-11-26).
    p.add_argument("--epochs", type=positive_int, default=10, help="fine-tuning passes per member")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="Adam learning rate")
    p.add_argument("--first-seed", type=non_negative_int, default=1, help="member i trains with seed FIRST_SEED + i")
    p.add_argument(
        "--bootstrap",
        action="store_true",
        help="each member fine-tunes on its own bootstrap resample of the base's training split",
    )
    p.add_argument("--jobs", type=positive_int, default=2, help="members trained in parallel, one thread each")
    p.add_argument("--data", type=data_spec, help="data spec (none: the base model's)")
    p.add_argument("--batch-size", type=positive_int, default=128, help="examples per step")
    p.add_argument("--device", default="auto", help="each member's device: auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per member")
    p.add_argument("--workers", type=non_negative_int, default=0, help="decoding processes per member")
    p.add_argument(
        "--time-budget",
        dest="time_budget_s",
        type=positive_float,
        metavar="SECONDS",
        help="language models: each member's training seconds (default 240; classifiers train for --epochs)",
    )
    p.add_argument(
        "--exit-loss", type=non_negative_float, help="language models: exit-aware members (default: the base's)"
    )
    p.add_argument(
        "--exit-dropout",
        type=probability_below_one,
        help="language models: see train --exit-dropout (default: the base's)",
    )
    lm.remember_flags(p)


def run(args: argparse.Namespace) -> int:
    if lm.is_lm_dir(args.base):
        return lm.family_command(args)
    from layerswarm.training.family import FamilyJob, train_family

    job = FamilyJob(
        base=args.base,
        out=args.out,
        members=args.members,
        prefix=args.prefix,
        variant=args.variant,
        epochs=args.epochs,
        lr=args.lr,
        first_seed=args.first_seed,
        bootstrap=args.bootstrap,
        jobs=args.jobs,
        data=args.data,
        batch_size=args.batch_size,
        device=args.device,
        threads=args.threads,
        workers=args.workers,
        overwrite=args.overwrite,
    )
    result = train_family(job)
    if result.failed:
        print(f"layerswarm family: {result.failed} member(s) failed", file=sys.stderr)
        return 1
    for path, m in result.members:
        print(
            f"{path.name}: {m.model_id} family {m.family_id} seq {m.metrics.get('test_sequential')} "
            f"arb {m.metrics.get('test_arbitrary')}"
        )
    return 0
