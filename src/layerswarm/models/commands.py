"""What `layerswarm train`, `family` and `eval` do (their flags live in layerswarm/cli/)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .checkpoint import MANIFEST, read_manifest, save_model
from .config import patch_size_for
from .data import Dataset, load_dataset
from .evaluate import EvalPlan, check_targets, evaluate_models
from .learned import (
    against_inherited,
    against_reference,
    inherited_reference,
    inherited_training_seconds,
    majority_baseline,
)
from .recipe import recipe_from_args
from .size import AUTO, choose_size
from .train import Trainer, build_model, check_same_classes, evaluate_loss, init_image_size
from .train_report import below_majority_warning, best_epoch, describe_epoch, near_chance_warning, render_history
from .train_state import TRAIN_STATE
from .vit import ViT

log = logging.getLogger(__name__)


def pick_train_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train_main(args: argparse.Namespace) -> int:
    from .text.data import is_text_spec

    check_out_writable(args.out, args.resume, args.overwrite)
    if is_text_spec(args.data):
        from .text.commands import text_train_main

        return text_train_main(args)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_train_device(args.device)
    image_size = resolve_image_size(args.init, args.image_size)
    patch_size = args.patch_size or patch_size_for(image_size or 32, args.stem)
    if args.init is None and (image_size or 32) % patch_size:
        raise ValueError(f"--image-size {image_size or 32} is not a multiple of --patch-size {patch_size}")
    data = load_dataset(
        args.data,
        seed=args.data_seed,
        image_size=image_size,
        workers=args.workers,
        memory_limit_bytes=args.data_memory_mb << 20,
    )
    if args.patch_size is None and args.init is None:  # the data's own size decides (imagefolder: native)
        patch_size = patch_size_for(data.image_shape[1], args.stem)
    if getattr(args, "token_depth", None):
        raise ValueError("--token-depth is for text models (per-token depth); this is image data")
    size = chosen_size(args, train_images=len(data.train_y), image_size=data.image_shape[1])
    arch = {"depth": size["depth"], "dim": size["dim"], "heads": size["heads"], "patch_size": patch_size}
    arch["stem"] = args.stem
    model, lineage = build_model(data, args.variant, args.init, arch, args.seed)
    recipe = recipe_from_args(args, augment=not args.no_augment, hflip=args.hflip, stem=model.cfg.stem)
    trainer = Trainer(model, data, recipe, device, args.out / TRAIN_STATE, workers=args.workers)
    if args.resume:
        trainer.load_state()
    fit_started = time.perf_counter()
    trainer.fit(on_epoch=lambda record: tqdm.write(describe_epoch(record, recipe.epochs), file=sys.stderr))
    fit_seconds = time.perf_counter() - fit_started
    inherited_s = inherited_training_seconds(args.init)
    _report_run(trainer, len(data.class_names))
    model = trainer.model.eval()
    metrics: dict[str, Any] = dict(_quick_metrics(model, data, args.workers))
    if args.reference:
        # A fine-tune's ViT is its ancestors' training plus its own: the reference gets all of it, or a
        # family member (a few seconds of fine-tuning) was reported 2.6 x a CNN trained for one second.
        budget = args.reference_seconds or fit_seconds + inherited_s
        metrics["learned"] = against_reference(trainer, data, budget, args.workers)
    elif (inherited := inherited_reference(args.init)) is not None:  # a family member: the base's CNN
        metrics["learned"] = against_inherited(trainer, inherited, str(args.init), len(data.class_names))
    model = model.cpu()
    recipe_record = {
        **asdict(recipe),
        "init": args.init,
        "size": size if args.init is None else None,  # a fine-tune keeps its parent's width and depth
        "command": args.command_line,
        "history": trainer.history,
        # wall-clock seconds of training behind these weights, the --init model's lineage included
        "training_seconds_total": round(fit_seconds + inherited_s, 1),
        "stopped": trainer.stopped or f"ran all {recipe.epochs} epochs",
        "seconds": round(time.perf_counter() - started, 1),
    }
    dataset = {**data.describe(), "data_seed": args.data_seed, "image_size": model.cfg.image_size}
    manifest = save_model(model, args.out, lineage, recipe=recipe_record, dataset=dataset, metrics=metrics)
    print(
        json.dumps(
            {
                "event": "trained",
                "out": str(args.out),
                "model_id": manifest.model_id,
                "family_id": manifest.family_id,
                "variant": args.variant,
                **metrics,
            }
        )
    )
    return 0


def check_out_writable(out: Path, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse an --out that cannot be written before any data is decoded or trained on: it failed when the
    first epoch's train state was saved, an epoch (minutes, on a large folder) later. access(2) also says
    so for root on a read-only mount. Refuse, too, an --out that holds a trained model or an interrupted
    run's state unless asked: a second command with the same --out replaced a model (minutes or hours of
    training, perhaps a family's base) without a word."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == out else f" ({existing} is not writable)"
        raise ValueError(f"--out {out}: cannot write the model directory there{where}")
    if overwrite:
        return
    if (out / MANIFEST).exists() and not resume:
        raise ValueError(f"--out {out} already holds a trained model: another folder, or --overwrite to replace it")
    if (out / TRAIN_STATE).exists() and not resume:
        raise ValueError(
            f"--out {out} holds an unfinished run's state: --resume to continue it, or --overwrite to start over"
        )


def _report_run(trainer: Trainer, num_classes: int) -> None:
    """The summary table, and a warning when the kept model is near chance (stderr: stdout is the JSON)."""
    history = trainer.history
    print(render_history(history, best_epoch(history)), file=sys.stderr)
    warning = near_chance_warning(history, num_classes, trainer.model.cfg.shuffle_robust)
    if warning:
        log.warning("%s", warning)
        return
    common, baseline = majority_baseline(trainer)
    names = trainer.data.class_names
    name = names[common] if common < len(names) else str(common)
    warning = below_majority_warning(history, baseline, name, num_classes, trainer.model.cfg.shuffle_robust)
    if warning:
        log.warning("%s", warning)


def _quick_metrics(model: ViT, data: Dataset, workers: int, orders: int = 5) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    x, y = data.test_x, data.test_y
    _, seq = evaluate_loss(model, x, y, workers=workers)
    depth = len(model.blocks)
    arb = [
        evaluate_loss(model, x, y, order=torch.randperm(depth, generator=gen).tolist(), workers=workers)[1]
        for _ in range(orders)
    ]
    return {"test_sequential": round(seq, 4), "test_arbitrary": round(sum(arb) / len(arb), 4)}


def chosen_size(args: argparse.Namespace, train_images: int | None, image_size: int | None) -> dict[str, Any]:
    """--size (auto: from the data) with any of --dim/--depth/--heads in its place; a ValueError (the CLI's
    exit 2) names the flags when they do not fit together."""
    return choose_size(
        getattr(args, "size", AUTO),
        args.dim,
        args.depth,
        args.heads,
        train_images=train_images,
        image_size=image_size,
        time_budget_s=args.time_budget_s,
    )


def resolve_image_size(init: str | None, asked: int | None) -> int | None:
    """The image side to decode data at: the --init model's own, else --image-size, else the data's native."""
    own = init_image_size(init) if init else None
    if own is not None and asked is not None and asked != own:
        raise ValueError(f"--image-size {asked} does not match the --init model's image size {own}")
    return own or asked


def inherited_augmentation(recipe: dict[str, Any]) -> list[str]:
    """The base's augmentation and regularisation choices as `train` flags: members learn under the
    base's rules (a base trained without flips must not get member fine-tunes that flip). Manifests
    written before `hflip` was recorded flipped whenever they augmented."""
    drop_path, mixup = float(recipe.get("drop_path", 0.0)), float(recipe.get("mixup", 0.0))
    regularise = (["--drop-path", str(drop_path)] if drop_path else []) + (["--mixup", str(mixup)] if mixup else [])
    augment = bool(recipe.get("augment", True))
    if not augment:
        return ["--no-augment", *regularise]
    return (["--hflip"] if recipe.get("hflip", augment) else []) + regularise


def family_main(args: argparse.Namespace) -> int:
    base = read_manifest(args.base)
    data = args.data or base.dataset.get("spec")
    if not data:
        raise ValueError("--data is needed (the base manifest names no dataset)")
    data_seed = str(base.dataset.get("data_seed", 0))
    outs = [args.out / f"{args.prefix}-{i}" for i in range(args.members)]
    for out in outs:  # before any member trains: not a refusal from member 3 after members 0-2 ran
        check_out_writable(out, overwrite=args.overwrite)
    cmds = []
    for i, out in enumerate(outs):
        cmds.append(
            [
                sys.executable,
                "-m",
                "layerswarm",
                "train",
                "--data",
                data,
                "--data-seed",
                data_seed,
                "--variant",
                args.variant,
                "--init",
                str(args.base),
                "--out",
                str(out),
                "--epochs",
                str(args.epochs),
                "--lr",
                str(args.lr),
                "--seed",
                str(args.first_seed + i),
                "--batch-size",
                str(args.batch_size),
                "--device",
                args.device,
                "--threads",
                str(args.threads),
                "--workers",
                str(args.workers),
                # The base's manifest holds the comparison with the reference CNN; a member's own would
                # train one for as long as the base and the member together (a member is both).
                "--no-reference",
                *(["--overwrite"] if args.overwrite else []),
                *inherited_augmentation(base.recipe),
            ]
        )
    failed = _run_parallel(cmds, args.jobs)
    if failed:
        print(f"layerswarm family: {failed} member(s) failed", file=sys.stderr)
        return 1
    for i in range(args.members):
        m = read_manifest(args.out / f"{args.prefix}-{i}")
        print(
            f"{args.prefix}-{i}: {m.model_id} family {m.family_id} seq {m.metrics.get('test_sequential')} "
            f"arb {m.metrics.get('test_arbitrary')}"
        )
    return 0


def _run_parallel(cmds: list[list[str]], jobs: int) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pending, failed = list(cmds), 0
    running: list[subprocess.Popen[bytes]] = []
    while pending or running:
        while pending and len(running) < max(1, jobs):
            running.append(subprocess.Popen(pending.pop(0), env=env))
        time.sleep(0.5)
        for proc in [p for p in running if p.poll() is not None]:
            running.remove(proc)
            failed += proc.returncode != 0
    return failed


def eval_main(args: argparse.Namespace) -> int:
    first = read_manifest(args.model_dirs[0])  # a ModelDirError (ValueError) is the CLI's exit 2 with its message
    spec = args.data or first.dataset.get("spec")
    if not spec:
        raise ValueError("--data is needed (the manifest names no dataset)")
    if first.config.is_text:
        from .text.commands import text_eval_main

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
        from .data import with_test_noise

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
        from .adaptive_eval import render_calibration

        print(render_calibration(report["calibration"]))
    return 0


def write_policies(model_dirs: list[Path], report: dict[str, Any], data: Dataset, margin: float) -> None:
    """Into each model dir: its minimum useful depth (its family's pruning curve when it has one, in
    arbitrary order for shuffle-robust variants) and per-position activation statistics."""
    from .checkpoint import load_model
    from .data import iterate_batches
    from .evaluate import activation_stats, min_useful_depth, odd_images
    from .policy import ACTIVATION_STATS, MIN_BLOCKS, write_entry

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
    from .adaptive_eval import calibrate_model
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
        lines.append(
            f"| ensemble of {n} members (mean logits) | {g['variant']} | {g['ensemble_sequential']:.4f} | "
            f"{g['ensemble']:.4f} |"
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
            shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            lines.append(f"| {key.split('/')[-1]}: {name} | {shown} |")
    return "\n".join(lines)
