"""`layerswarm eval`: the paper's experiments (orders, pruning, merging, ensembles) on model directories."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch: imported when models are evaluated, not when the parser is built
    from layerswarm.training.evaluation.report import EvalReport
    from layerswarm.training.evaluation.runs import EvalJob

from . import lm
from .base import Subparsers, add_command, int_at_least, non_negative_float, positive_int
from .train import add_image_args, data_spec


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "eval",
        run,
        help="the paper's experiments: orders, pruning, merging, ensembles",
        description="Sequential and arbitrary-order accuracy, pruning, merged models and ensembles, as JSON "
        "(and plots). An ensemble's margin over its best member comes with a paired bootstrap 95% interval "
        "over the test images and a verdict (above, within noise, below): on 1,000 test images a margin of "
        "half a point is noise; --data with a larger held-out folder narrows the interval.",
    )
    p.add_argument("model_dirs", nargs="+", type=Path, help="model directories (a family's members, baselines...)")
    p.add_argument("--json", type=Path, help="also write the report as JSON here (the table goes to stdout)")
    p.add_argument("--plots", type=Path, help="write figures (PNG) into this folder")
    p.add_argument("--data", type=data_spec, help="data spec (none: the first model's)")
    p.add_argument(
        "--orders", type=int_at_least(10), default=10, help="random orders per arbitrary-order figure (>= 10)"
    )
    p.add_argument("--merges", type=int_at_least(20), default=20, help="random merged models per family (>= 20)")
    add_image_args(p, train=False)
    p.add_argument("--seed", type=int, default=0, help="seed of orders and merges")
    p.add_argument(
        "--min-depth-margin",
        type=non_negative_float,
        default=0.01,
        help="minimum useful depth: fewest blocks within this accuracy of full depth (default: %(default)s)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="also calibrate adaptive compute (exit rules, ensembles, repeated blocks) per model and write "
        "each model's policy (DIR/adaptive.json, hashed in the manifest) for the coordinator",
    )
    p.add_argument("--calibrate-only", action="store_true", help="calibrate, skip the paper's experiments")
    p.add_argument(
        "--margin", type=percentage_points, default=1.0, help="points of accuracy an exit may lose vs the full path"
    )
    p.add_argument("--exit-min-blocks", type=positive_int, default=1, help="no exit before this depth")
    p.add_argument(
        "--anytime-margin",
        type=percentage_points,
        default=10.0,
        help="points of accuracy an answer cut by a request's deadline may lose vs the full path: the anytime "
        "floor is the fewest blocks within it",
    )
    p.add_argument(
        "--test-noise",
        type=non_negative_float,
        default=0.0,
        help="add seeded Gaussian noise of this std to the test images: a harder held-back split (calibration "
        "on it never writes a policy)",
    )
    p.add_argument(
        "--no-write-policy", action="store_true", help="calibrate, but leave the model directories as they are"
    )
    p.add_argument(
        "--no-policy",
        action="store_true",
        help="do not write min depth and activation statistics into the model directories' manifests",
    )
    p.add_argument(
        "--policy-out",
        type=Path,
        metavar="DIR",
        help="write what is measured into copies of the model directories under DIR (needed for shipped "
        "models, which are never written: they belong to the installed package)",
    )


def percentage_points(text: str) -> float:
    """argparse type: points of accuracy, 0 to 100."""
    value = non_negative_float(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"must be between 0 and 100 points, got {text}")
    return value


def writes_policy(args: argparse.Namespace) -> bool:
    """Whether this run writes into the model directories (min depth and statistics, or calibration)."""
    experiments = not args.calibrate_only and not args.no_policy
    calibration = (args.calibrate or args.calibrate_only) and not args.no_write_policy and not args.test_noise
    return experiments or calibration


def run(args: argparse.Namespace) -> int:
    if lm.is_lm_dir(args.model_dirs[0]):  # a decoder family: perplexity and exact match (training/lm)
        from .model_dirs import policy_targets

        if writes_policy(args):
            args.model_dirs = policy_targets(args.model_dirs, args.policy_out, no_write_flag="--no-policy")
        return lm.eval_command(args)
    from layerswarm.training.evaluation.adaptive import render_calibration
    from layerswarm.training.evaluation.report import render_table
    from layerswarm.training.evaluation.runs import eval_data, evaluate_image_models
    from layerswarm.training.text.runs import evaluate_text_models

    job = eval_job(args)
    spec, first = eval_data(job)
    if first.config.is_text:
        report = evaluate_text_models(job, spec)
    else:
        report = evaluate_image_models(job, spec, first)
    write_json(args.json, report)
    if args.plots:
        draw_plots(args.plots, report)
    if report["models"]:
        print(render_table(report))
    if report.get("calibration"):
        print(render_calibration(report["calibration"]))
    return 0


def eval_job(args: argparse.Namespace) -> EvalJob:
    """The job a `layerswarm eval` command line asks for; model directories it would write into are
    copies under --policy-out where asked (shipped models are never written)."""
    from layerswarm.training.evaluation.calibrate import CalibrationPlan
    from layerswarm.training.evaluation.runs import EvalJob

    from .model_dirs import policy_targets

    model_dirs = args.model_dirs
    if writes_policy(args):
        model_dirs = policy_targets(model_dirs, args.policy_out, no_write_flag="--no-policy")
    # --margin, --anytime-margin (0-100) and --exit-min-blocks (>= 1): checked by the parser
    calibration = CalibrationPlan(
        margin=args.margin / 100.0,
        min_blocks=args.exit_min_blocks,
        seed=args.seed,
        anytime_margin=args.anytime_margin / 100.0,
    )
    return EvalJob(
        model_dirs=tuple(model_dirs),
        data=args.data,
        orders=args.orders,
        merges=args.merges,
        seed=args.seed,
        workers=args.workers,
        data_memory_mb=args.data_memory_mb,
        experiments=not args.calibrate_only,
        write_policy=not args.no_policy,
        min_depth_margin=args.min_depth_margin,
        calibrate=args.calibrate or args.calibrate_only,
        calibration=calibration,
        write_calibration=not args.no_write_policy,
        test_noise=args.test_noise,
    )


def write_json(path: Path | None, report: Mapping[str, Any]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


def draw_plots(folder: Path, report: EvalReport) -> None:
    """The paper's figures of the report: pruning, merged models, exits (those it has data for)."""
    from layerswarm.training.evaluation.plots import plot_exits, plot_merged, plot_pruning

    folder.mkdir(parents=True, exist_ok=True)
    if report["models"]:
        plot_pruning(report, folder / "accuracy_vs_blocks.png")
    if report["groups"]:
        plot_merged(report, folder / "merged.png")
    if report.get("calibration"):
        plot_exits(report, folder / "exits.png")
