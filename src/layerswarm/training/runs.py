"""One training run from a typed job: what `layerswarm train` does once cli/train.py has read its flags.

    TrainJob -> check the output folder -> load the data -> size and build the model (fresh, fine-tuned
    or imported) -> the recipe gets its stem and time budget -> Trainer.fit -> quick test metrics and the
    reference CNN -> save_model -> Trained

Text data takes the same job (training/text/runs.py). Progress and the run's table go to stderr; the
result is returned, for the caller to show.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from typing_extensions import NotRequired, TypedDict

from layerswarm.models.checkpoint import MANIFEST, Manifest, save_model
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
from .recipe import TrainRecipe, from_scratch_time_budget
from .reference import LearnedRecord
from .size import AUTO, SizeChoice, choose_size
from .train import Trainer, build_model, init_image_size
from .train_report import below_majority_warning, best_epoch, describe_epoch, near_chance_warning, render_history
from .train_state import TRAIN_STATE, saved_time_budget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainJob:
    """One `layerswarm train`: the data, the output folder, the recipe the command line asked for, and
    what the data and the --init model may still decide (None: let them)."""

    data: str  # a data spec (training/data/datasets.py, training/text/data.py)
    out: Path
    recipe: TrainRecipe  # the command line's; an image run sets its stem and time budget from the model and data
    init: str | None = None  # a model directory or hf:PATH to start from; None: from scratch
    time_budget_s: float | None = None  # asked for; None: a resumed run's own, else from the data (images)
    data_seed: int = 0
    # A model from scratch: a named size (--size) with any of dim/depth/heads in its place, its stem, its patch
    # side (None: from the image size) and image side (None: the data's native; with --init the model's own).
    size: str = AUTO
    dim: int | None = None
    depth: int | None = None
    heads: int | None = None
    stem: str = TrainRecipe.stem
    patch_size: int | None = None
    image_size: int | None = None
    max_tokens: int = 32  # text from scratch: the longest sequence, [CLS] included
    vocab_size: int = 8000  # text from scratch: the tokenizer's vocabulary
    workers: int = 0  # processes decoding image folders
    data_memory_mb: int = 2048  # image folders larger than this once decoded stream from disk
    reference: bool = True  # train the reference CNN beside the ViT (else a family member's base's)
    reference_seconds: float = 0.0  # its budget (0: the ViT's own training time)
    device: str = "auto"
    resume: bool = False
    overwrite: bool = False
    command_line: str = ""  # recorded in the manifest: how the model was made


class TrainMetrics(TypedDict):
    """A trained model's `metrics` (its manifest's): test accuracy in order and over random orders, and
    what it learned against chance and the reference CNN."""

    test_sequential: float
    test_arbitrary: float
    learned: NotRequired[LearnedRecord]


@dataclass(frozen=True)
class Trained:
    out: Path
    manifest: Manifest
    metrics: TrainMetrics


def train_image_model(job: TrainJob) -> Trained:
    started = time.perf_counter()
    check_out_writable(job.out, job.resume, job.overwrite)
    if job.recipe.threads:
        torch.set_num_threads(job.recipe.threads)
    device = pick_train_device(job.device)
    image_size = resolve_image_size(job.init, job.image_size)
    patch_size = job.patch_size or patch_size_for(image_size or 32, job.stem)
    if job.init is None and (image_size or 32) % patch_size:
        raise ValueError(f"--image-size {image_size or 32} is not a multiple of --patch-size {patch_size}")
    data = load_dataset(
        job.data,
        seed=job.data_seed,
        image_size=image_size,
        workers=job.workers,
        memory_limit_bytes=job.data_memory_mb << 20,
    )
    if job.patch_size is None and job.init is None:  # the data's own size decides (imagefolder: native)
        patch_size = patch_size_for(data.image_shape[1], job.stem)
    if job.recipe.token_depth:
        raise ValueError("--token-depth is for text models (per-token depth); this is image data")
    saved_s = saved_time_budget(job.out / TRAIN_STATE) if job.resume else None
    budget_s = image_time_budget(job.time_budget_s, job.init, len(data.train_y), saved_s)
    size = chosen_size(job, train_images=len(data.train_y), image_size=data.image_shape[1], time_budget_s=budget_s)
    arch: dict[str, Any] = {"depth": size["depth"], "dim": size["dim"], "heads": size["heads"]}
    arch.update(patch_size=patch_size, stem=job.stem)
    model, lineage = build_model(data, job.recipe.variant, job.init, arch, job.recipe.seed)
    recipe = dataclasses.replace(job.recipe, stem=model.cfg.stem, time_budget_s=budget_s)
    trainer = Trainer(model, data, recipe, device, job.out / TRAIN_STATE, workers=job.workers)
    if job.resume:
        trainer.load_state()
    fit_started = time.perf_counter()
    trainer.fit(on_epoch=lambda record: tqdm.write(describe_epoch(record, recipe.epochs), file=sys.stderr))
    fit_seconds = time.perf_counter() - fit_started
    inherited_s = inherited_training_seconds(job.init)
    report_run(trainer, len(data.class_names))
    model = trainer.model.eval()
    metrics = quick_metrics(model, data, job.workers)
    if job.reference:
        # A fine-tune's ViT is its ancestors' training plus its own: the reference gets all of it, or a
        # family member (a few seconds of fine-tuning) was reported 2.6 x a CNN trained for one second.
        budget = job.reference_seconds or fit_seconds + inherited_s
        metrics["learned"] = against_reference(trainer, data, budget, job.workers)
    elif (inherited := inherited_reference(job.init)) is not None:  # a family member: the base's CNN
        metrics["learned"] = against_inherited(trainer, inherited, str(job.init), len(data.class_names))
    model = model.cpu()
    recipe_record = {
        **asdict(recipe),
        "init": job.init,
        "size": size if job.init is None else None,  # a fine-tune keeps its parent's width and depth
        "command": job.command_line,
        "history": trainer.history,
        # wall-clock seconds of training behind these weights, the --init model's lineage included
        "training_seconds_total": round(fit_seconds + inherited_s, 1),
        "stopped": trainer.stopped or f"ran all {recipe.epochs} epochs",
        "seconds": round(time.perf_counter() - started, 1),
    }
    dataset = {**data.describe(), "data_seed": job.data_seed, "image_size": model.cfg.image_size}
    manifest = save_model(model, job.out, lineage, recipe=recipe_record, dataset=dataset, metrics=dict(metrics))
    return Trained(job.out, manifest, metrics)


def pick_train_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


def report_run(trainer: Trainer, num_classes: int) -> None:
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


def quick_metrics(model: ViT, data: Dataset, workers: int, orders: int = 5) -> TrainMetrics:
    gen = torch.Generator().manual_seed(0)
    x, y = data.test_x, data.test_y
    _, seq = evaluate_loss(model, x, y, workers=workers)
    depth = len(model.blocks)
    arb = [
        evaluate_loss(model, x, y, order=torch.randperm(depth, generator=gen).tolist(), workers=workers)[1]
        for _ in range(orders)
    ]
    return {"test_sequential": round(seq, 4), "test_arbitrary": round(sum(arb) / len(arb), 4)}


def image_time_budget(asked: float | None, init: str | None, train_images: int, saved: float | None = None) -> float:
    """--time-budget if given (`asked`); else a resumed run's own (`saved`); else, from scratch, the longer
    budget more images need (recipe.from_scratch_time_budget), and for a fine-tune the recipe's default
    (its epochs end it)."""
    if asked is not None:
        return float(asked)
    if saved is not None:
        return saved
    return from_scratch_time_budget(train_images) if init is None else TrainRecipe.time_budget_s


def chosen_size(job: TrainJob, train_images: int | None, image_size: int | None, time_budget_s: float) -> SizeChoice:
    """--size (auto: from the data) with any of --dim/--depth/--heads in its place; a ValueError (the CLI's
    exit 2) names the flags when they do not fit together."""
    return choose_size(
        job.size,
        job.dim,
        job.depth,
        job.heads,
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
