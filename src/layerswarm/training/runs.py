"""What `layerswarm train` and `family` do (their flags live in layerswarm/cli/; `eval`: eval_command.py)."""

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

from layerswarm.models.checkpoint import MANIFEST, read_manifest, save_model
from layerswarm.models.config import patch_size_for
from layerswarm.models.vit import ViT

from .data.datasets import Dataset, load_dataset
from .learned import (
    against_inherited,
    against_reference,
    inherited_reference,
    inherited_training_seconds,
    majority_baseline,
)
from .objective import evaluate_loss
from .recipe import TrainRecipe, from_scratch_time_budget, recipe_from_args
from .size import AUTO, choose_size
from .train import Trainer, build_model, init_image_size
from .train_report import below_majority_warning, best_epoch, describe_epoch, near_chance_warning, render_history
from .train_state import TRAIN_STATE, saved_time_budget

log = logging.getLogger(__name__)


def pick_train_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train_main(args: argparse.Namespace) -> int:
    from .text.data import is_text_spec

    check_out_writable(args.out, args.resume, args.overwrite)
    if is_text_spec(args.data):
        from .text.runs import text_train_main

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
    saved_s = saved_time_budget(args.out / TRAIN_STATE) if args.resume else None
    budget_s = image_time_budget(args, len(data.train_y), saved_s)
    size = chosen_size(args, train_images=len(data.train_y), image_size=data.image_shape[1], time_budget_s=budget_s)
    arch = {"depth": size["depth"], "dim": size["dim"], "heads": size["heads"], "patch_size": patch_size}
    arch["stem"] = args.stem
    model, lineage = build_model(data, args.variant, args.init, arch, args.seed)
    recipe = recipe_from_args(
        args, augment=not args.no_augment, hflip=args.hflip, stem=model.cfg.stem, time_budget_s=budget_s
    )
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


def image_time_budget(args: argparse.Namespace, train_images: int, saved: float | None = None) -> float:
    """--time-budget if given; else a resumed run's own (`saved`); else, from scratch, the longer budget
    more images need (recipe.from_scratch_time_budget), and for a fine-tune the recipe's default (its
    epochs end it)."""
    if args.time_budget_s is not None:
        return float(args.time_budget_s)
    if saved is not None:
        return saved
    return from_scratch_time_budget(train_images) if args.init is None else TrainRecipe.time_budget_s


def chosen_size(
    args: argparse.Namespace,
    train_images: int | None,
    image_size: int | None,
    time_budget_s: float,
) -> dict[str, Any]:
    """--size (auto: from the data) with any of --dim/--depth/--heads in its place; a ValueError (the CLI's
    exit 2) names the flags when they do not fit together."""
    return choose_size(
        getattr(args, "size", AUTO),
        args.dim,
        args.depth,
        args.heads,
        train_images=train_images,
        image_size=image_size,
        time_budget_s=time_budget_s,
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
    # The base's validation split, whatever each member's training seed: a member validating on a split
    # of its own would validate on images its base trained on.
    split_seed = base.recipe.get("split_seed")
    split_seed = str(base.recipe.get("seed", 0) if split_seed is None else split_seed)
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
                "--split-seed",
                split_seed,
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
                *(["--bootstrap"] if args.bootstrap else []),
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
