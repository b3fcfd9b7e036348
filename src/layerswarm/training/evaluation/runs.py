"""What `layerswarm eval` does (its flags live in layerswarm/cli/eval.py): accuracy in order and in
arbitrary orders, merges, ensembles and pruning for a family, the targets, and the policies written
into each model dir."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

from layerswarm.models.checkpoint import read_manifest

from ..data.datasets import Dataset, load_dataset
from ..train import check_same_classes
from .evaluate import EvalPlan, check_targets, evaluate_models

log = logging.getLogger(__name__)


def eval_main(args: argparse.Namespace) -> int:
    first = read_manifest(args.model_dirs[0])  # a ModelDirError (ValueError) is the CLI's exit 2 with its message
    spec = args.data or first.dataset.get("spec")
    if not spec:
        raise ValueError("--data is needed (the manifest names no dataset)")
    if first.config.is_text:
        from ..text.runs import text_eval_main

        return text_eval_main(args, spec)
    data = load_dataset(
        spec,
        seed=int(first.dataset.get("data_seed", 0)),
        image_size=first.config.image_size,  # every member of a family has its base's size
        workers=args.workers,
        memory_limit_bytes=args.data_memory_mb << 20,
    )
    for model_dir in args.model_dirs:
        check_same_classes(read_manifest(model_dir).config.class_names, data.class_names, str(model_dir))
    if args.test_noise:
        from ..data.datasets import with_test_noise

        data = with_test_noise(data, args.test_noise)
        args.no_write_policy = True  # a policy is calibrated on the data the model serves
    report: dict[str, Any] = {"dataset": data.describe(), "models": {}, "groups": {}}
    if not args.calibrate_only:
        plan = EvalPlan(orders=args.orders, merges=args.merges, seed=args.seed, workers=args.workers)
        report = evaluate_models([str(d) for d in args.model_dirs], data, plan)
        report["targets"] = check_targets(report, chance=1.0 / len(data.class_names))
        if not args.no_policy:
            write_policies(args.model_dirs, report, data, args.min_depth_margin)
    if args.calibrate or args.calibrate_only:
        report["calibration"] = _calibrate(args, data)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plots:
        from .plots import plot_exits, plot_merged, plot_pruning

        args.plots.mkdir(parents=True, exist_ok=True)
        if report["models"]:
            plot_pruning(report, args.plots / "accuracy_vs_blocks.png")
        if report["groups"]:
            plot_merged(report, args.plots / "merged.png")
        if report.get("calibration"):
            plot_exits(report, args.plots / "exits.png")
    if report["models"]:
        print(render_table(report))
    if report.get("calibration"):
        from .adaptive import render_calibration

        print(render_calibration(report["calibration"]))
    return 0


def write_policies(model_dirs: list[Path], report: dict[str, Any], data: Dataset, margin: float) -> None:
    """Into each model dir: its minimum useful depth (its family's pruning curve when it has one, in
    arbitrary order for shuffle-robust variants) and per-position activation statistics."""
    from layerswarm.models.checkpoint import load_model
    from layerswarm.models.policy import ACTIVATION_STATS, MIN_BLOCKS, write_entry

    from ..data.datasets import iterate_batches
    from .evaluate import activation_stats, min_useful_depth, odd_images

    test = torch.cat(list(iterate_batches(data.test_x, [torch.arange(min(len(data.test_y), 2048))])))
    images = torch.cat([test, odd_images(test)])
    for model_dir in model_dirs:
        name = str(model_dir).rstrip("/").rsplit("/", 1)[-1]
        row = report["models"][name]
        group = report["groups"].get(f"{row['family_id']}/{row['variant']}")
        order = "arbitrary" if row["variant"].startswith("layershuffle") else "sequential"
        depth_policy = min_useful_depth((group or row)["pruned"], order, margin)
        depth_policy["measured_on"] = "family" if group else "model"
        write_entry(model_dir, MIN_BLOCKS, depth_policy)
        model, _ = load_model(model_dir)
        write_entry(model_dir, ACTIVATION_STATS, activation_stats(model, images))
        log.info("%s: min_blocks %d", name, depth_policy["value"])


def _calibrate(args: argparse.Namespace, data: Any) -> dict[str, Any]:
    from .adaptive import calibrate_model
    from .calibrate import CalibrationPlan

    # --margin (0-100) and --exit-min-blocks (>= 1): checked by the parser (cli/eval.py)
    plan = CalibrationPlan(margin=args.margin / 100.0, min_blocks=args.exit_min_blocks, seed=args.seed)
    return {
        str(d).rstrip("/").rsplit("/", 1)[-1]: calibrate_model(d, data, plan, write=not args.no_write_policy)
        for d in args.model_dirs
    }


def render_table(report: dict[str, Any]) -> str:
    """The report as markdown: accuracy per model and group, pruning, and the targets."""
    lines = ["| model | variant | sequential | arbitrary order (mean ± std) |", "| --- | --- | --- | --- |"]
    for name, m in report["models"].items():
        a = m["arbitrary"]
        lines.append(f"| {name} | {m['variant']} | {m['sequential']:.4f} | {a['mean']:.4f} ± {a['std']:.4f} |")
    for g in report["groups"].values():
        n = len(g["members"])
        merged, merged_seq = g["merged"], g["merged_sequential"]
        lines.append(
            f"| merged, {merged['n']} random merges of {n} members | {g['variant']} | "
            f"{merged_seq['mean']:.4f} | {merged['mean']:.4f} ± {merged['std']:.4f} |"
        )
        spread = f" ± {g['ensemble_orders']['std']:.4f}" if "ensemble_orders" in g else ""
        lines.append(
            f"| ensemble of {n} members (mean logits) | {g['variant']} | {g['ensemble_sequential']:.4f} | "
            f"{g['ensemble']:.4f}{spread} |"
        )
    lines += ["", _render_pruning(report)]
    if report.get("targets"):
        lines += ["", _render_targets(report["targets"])]
    return "\n".join(lines)


def _render_pruning(report: dict[str, Any]) -> str:
    rows = {name: m["pruned"] for name, m in report["models"].items()}
    ks = sorted({int(k) for pruned in rows.values() for k in pruned})
    head = "| blocks kept: sequential / arbitrary | " + " | ".join(str(k) for k in ks) + " |"
    lines = [head, "| --- |" + " --- |" * len(ks)]
    for name, pruned in rows.items():
        cells = [f"{pruned[str(k)]['sequential']:.2f} / {pruned[str(k)]['arbitrary']:.2f}" for k in ks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _render_targets(targets: dict[str, Any]) -> str:
    lines = ["| check | value |", "| --- | --- |"]
    for key, checks in targets.items():
        for name, value in checks.items():
            if isinstance(value, list):  # an interval
                shown = "[" + ", ".join(f"{v:+.4f}" for v in value) + "] (95%)"
            else:
                shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            lines.append(f"| {key.split('/')[-1]}: {name} | {shown} |")
    return "\n".join(lines)
