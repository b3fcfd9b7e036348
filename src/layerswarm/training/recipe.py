"""The training recipe: every training default, stated once (torch-free, so the CLI's parser can show
them in --help without importing torch)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

# `layerswarm train`'s --shuffle-ramp for an image model trained from scratch (TrainRecipe.shuffle_ramp):
# in-order batches giving way to shuffled ones over two thirds of the schedule. Measured on the five
# generated tasks (docs/own-data.md): as good or better on each, and `compare` past its plateau far more often.
FROM_SCRATCH_SHUFFLE_RAMP = 0.67

# `layerswarm train`'s --time-budget for an image model trained from scratch (from_scratch_time_budget):
# 600 s up to 4,000 training images, 900 s (the 15 minutes a model may take) from 20,000, in between along
# the log of the count. At 20,000 images four of five generated tasks ended on a 600 s budget, not by
# early stopping, and `compare`'s default seed stayed on its plateau (0.73 x the reference CNN); with
# 900 s it got past it, another stuck seed did not (docs/own-data.md, "More images, more time").
BUDGET_FEW_IMAGES, BUDGET_MANY_IMAGES = 4_000, 20_000
BUDGET_FEW_S, BUDGET_MANY_S = 600.0, 900.0


@dataclass
class TrainRecipe:
    variant: str = "layershuffle"
    # How images become tokens for a model trained from scratch: "conv" (a few 3x3 convolutions, vit.ConvEmbed)
    # gives a small ViT the locality it cannot learn from a few thousand images; "patch" is the classic stem.
    stem: str = "conv"
    # Passes over the data at most: with the time budget and early stopping, usually not what ends a run.
    epochs: int = 200
    # Wall-clock seconds of training steps at most. The schedule is in optimizer steps: after the first epoch
    # it is cut to the steps this budget allows at that epoch's pace (never more than epochs x steps per
    # epoch), so the cosine still ends at a low rate when the budget, not the epochs, ends the run. 600 s
    # here; `layerswarm train` gives an image model from scratch from_scratch_time_budget(its images).
    time_budget_s: float = BUDGET_FEW_S
    # Stop when this many validations in a row did not lower the validation loss (0: never stop early),
    # counting from the end of the warm-up (Trainer.warming_up); the weights of the best validation are kept.
    patience: int = 8
    label_smoothing: float = 0.1  # images: softens the targets, which small models on small data overfit
    # Stochastic depth: the probability that a sample skips a block's attention or MLP branch in training.
    # Off by default: on the generated own-data tasks it cost accuracy in order and gained nothing in
    # arbitrary order (docs/own-data.md, docs/results/own-data-drop-path.json).
    drop_path: float = 0.0
    # Mixup (images only): each training batch is blended with a shuffled copy of itself, x = lam * x +
    # (1 - lam) * x[perm], and the loss weighs the two label sets by lam and 1 - lam; lam ~ Beta(a, a) per
    # batch, a this value (0: off). Validation and test never mix. Off by default: at 0.2 it cost accuracy on
    # the generated own-data tasks with the default early stopping and did not win without it
    # (docs/own-data.md, docs/results/own-data-mixup.json).
    mixup: float = 0.0
    # LayerShuffle from scratch: the share of the step schedule over which the chance that a batch runs its
    # blocks in a random order (not in order) rises linearly from 0 to 1; shuffled throughout after it. 0:
    # every batch shuffled from the first step. Only a model trained from scratch ramps (a fine-tune's base
    # already learnt the task), and the model kept is chosen after the ramp (Trainer.ramping). 0 here;
    # `layerswarm train` from scratch asks for FROM_SCRATCH_SHUFFLE_RAMP (cli/train.py, recipe_from_args).
    shuffle_ramp: float = 0.0
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 100
    seed: int = 0
    # The validation split's seed (None: the training seed). A family member takes its base's: with its own
    # seed, its validation images were ones the base trained on, and its early stopping, kept epoch and
    # reported accuracy were measured on them.
    split_seed: int | None = None
    val_fraction: float = 0.1
    # Train on a bootstrap resample of the training split (as many draws, with replacement, seeded by
    # `seed`): family members then see different data, for an ensemble whose members err differently.
    bootstrap: bool = False
    augment: bool = True  # small random shifts
    hflip: bool = False  # mirror images in augmentation: wrong wherever left and right carry meaning
    threads: int = 0  # 0: leave torch's default
    # Early-exit loss weight (LayerSkip-style): cross-entropy through the shared head after every
    # truncation depth of the batch's random order, so early answers are usable. 0: off.
    exit_loss: float = 0.0
    # Text: train with per-token depth (the --init model's "mi" or "reconstruction" table): each token
    # freezes after its depth, as served. "": every token runs every block.
    token_depth: str = ""

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch size must be at least 1, got {self.epochs} and {self.batch_size}")
        if self.time_budget_s <= 0 or self.patience < 0 or not 0 <= self.label_smoothing < 1:
            raise ValueError("time budget must be positive, patience at least 0, label smoothing in [0, 1)")
        if not 0 <= self.shuffle_ramp <= 1:
            raise ValueError(f"shuffle ramp must be a share of the schedule in [0, 1], got {self.shuffle_ramp}")
        if not 0 <= self.drop_path < 1:
            raise ValueError(f"drop path must be in [0, 1), got {self.drop_path}")
        if not 0 <= self.mixup < math.inf:  # nan fails every comparison
            raise ValueError(
                f"mixup (the Beta(a, a) parameter) must be a finite number of at least 0, got {self.mixup}"
            )


def from_scratch_time_budget(train_images: int) -> float:
    """The default time budget of an image model trained from scratch on `train_images` images: a longer
    schedule for more data, since the steps a run needs grow with it (whole seconds, so the manifest and a
    resume agree)."""
    span = math.log(BUDGET_MANY_IMAGES / BUDGET_FEW_IMAGES)
    share = min(1.0, max(0.0, math.log(max(train_images, 1) / BUDGET_FEW_IMAGES) / span))
    return float(round(BUDGET_FEW_S + share * (BUDGET_MANY_S - BUDGET_FEW_S)))


def recipe_changes(saved: dict[str, Any], recipe: TrainRecipe) -> list[str]:
    """How `recipe` differs from a `saved` one, one "field: saved -> now" line each (empty: the same).

    A field the saved recipe lacks was added to the trainer after that run started; every field is added
    with a default that keeps the earlier behaviour (drop_path and mixup 0: off), so the missing field
    reads as its default and an older run resumes unless the command asks for something else."""
    defaults = {f.name: f.default for f in fields(TrainRecipe)}
    now = asdict(recipe)
    unknown = sorted(set(saved) - set(now))
    changed = [
        f"{name}: {saved.get(name, defaults[name])!r} -> {value!r}"
        for name, value in now.items()
        if saved.get(name, defaults[name]) != value
    ]
    return changed + [f"{name}: {saved[name]!r} -> (no such setting in this version)" for name in unknown]
