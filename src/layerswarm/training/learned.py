"""What a training run learned: its validation accuracy against chance, against always answering the
most common class, and against a small reference CNN trained on the same split for the same time (or,
for a family member, its base's reference). Written into the manifest as `metrics.learned`."""

from __future__ import annotations

import logging
import sys

import torch
from tqdm import tqdm

from layerswarm.models.checkpoint import read_manifest

from .data.datasets import Dataset
from .reference import LearnedRecord, ReferenceResult, compare, far_behind_warning, train_reference
from .train import Trainer
from .train_report import kept_record

log = logging.getLogger(__name__)


def inherited_training_seconds(init: str | None) -> float:
    """Seconds of training behind an --init model directory, its own ancestors' included (0 from scratch
    or for a Hugging Face checkpoint, whose training is not on record). Manifests written before the total
    was recorded give the sum of their own epochs."""
    if init is None or init.startswith("hf:"):
        return 0.0
    recipe = read_manifest(init).recipe
    if "training_seconds_total" in recipe:
        return float(recipe["training_seconds_total"])
    return float(sum(float(r.get("seconds", 0.0)) for r in recipe.get("history", [])))


def majority_baseline(trainer: Trainer) -> tuple[int, float]:
    """The most common class of the training folder, and the validation accuracy of always answering it:
    what a model that learned only the class counts scores (about 1 / classes when they are equal). The
    whole folder's counts, not the split's: with equal classes, the class the validation split took the
    fewest of is the split's most common, and scored 0 on a small validation set."""
    common = int(torch.bincount(trainer.data.train_y).argmax())
    return common, float((trainer.val_y == common).float().mean())


def inherited_reference(init: str | None) -> ReferenceResult | None:
    """The reference CNN an --init model directory was compared with (None: none on record)."""
    if init is None or init.startswith("hf:"):
        return None
    reference = read_manifest(init).metrics.get("learned", {}).get("reference")
    return ReferenceResult(**reference) if isinstance(reference, dict) else None


def against_inherited(trainer: Trainer, reference: ReferenceResult, init: str, classes: int) -> LearnedRecord:
    """A fine-tune without its own reference (family members) against its base's: the same data and the
    base's training time, on the base's validation split (a member's own split is drawn from its seed)."""
    vit = kept_accuracies(trainer)
    record = compare(vit, reference, classes)
    record["reference_from"] = init
    record["majority_baseline"] = round(majority_baseline(trainer)[1], 4)
    warning = far_behind_warning(vit, reference)
    if warning:
        log.warning("%s", warning)
    return record


def kept_accuracies(trainer: Trainer) -> dict[str, float]:
    """Validation accuracy of the kept epoch: in order, and in arbitrary order for shuffle-robust variants."""
    kept = kept_record(trainer.history)
    if kept is None:
        raise ValueError("no epoch was trained: nothing to compare with the reference")
    vit = {"val_sequential": kept["val_acc"]}
    if trainer.model.cfg.shuffle_robust:
        vit["val_arbitrary"] = kept["val_acc_arbitrary"]
    return vit


def against_reference(trainer: Trainer, data: Dataset, budget_s: float, workers: int) -> LearnedRecord:
    """Train the reference CNN on the trainer's own split for `budget_s`, compare, warn when far behind."""
    x = data.train_x
    train_x = x[trainer.train_idx] if isinstance(x, torch.Tensor) else x.subset(trainer.train_idx)
    tqdm.write(f"reference: a small CNN on the same split for {budget_s:.0f} s...", file=sys.stderr)
    reference = train_reference(
        (train_x, data.train_y[trainer.train_idx]),
        (trainer.val_x, trainer.val_y),
        len(data.class_names),
        budget_s,
        seed=trainer.recipe.seed,
        workers=workers,
    )
    vit = kept_accuracies(trainer)
    record = compare(vit, reference, len(data.class_names))
    record["majority_baseline"] = round(majority_baseline(trainer)[1], 4)  # beside chance: unequal classes
    tqdm.write(
        f"learned: chance {record['chance']:.3f}, always the training folder's most common class "
        f"{record['majority_baseline']:.3f}, "
        f"reference CNN {reference.val_acc:.3f} in {reference.seconds:.0f} s, "
        + ", ".join(f"ViT {k} {v:.3f}" for k, v in vit.items()),
        file=sys.stderr,
    )
    warning = far_behind_warning(vit, reference)
    if warning:
        log.warning("%s", warning)
    return record
