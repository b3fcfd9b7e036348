"""The training recipe: every training default, stated once (torch-free, so the CLI's parser can show
them in --help without importing torch)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass
class TrainRecipe:
    variant: str = "layershuffle"
    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 100
    seed: int = 0
    val_fraction: float = 0.1
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


def recipe_from_args(args: argparse.Namespace, **overrides: Any) -> TrainRecipe:
    """The recipe a `layerswarm train` command line asks for (`overrides`: what the data decides)."""
    fields = ("variant", "epochs", "batch_size", "lr", "weight_decay", "warmup_steps", "seed", "threads", "exit_loss")
    if getattr(args, "token_depth", None):
        overrides = {"token_depth": args.token_depth, **overrides}
    return TrainRecipe(**{name: getattr(args, name) for name in fields}, **overrides)
