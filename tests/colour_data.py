"""Colour classes: four classes told apart by colour alone under noise, which any model here learns in a
few dozen steps. The tests that need a learnable task without a dataset on disk share this one."""

from __future__ import annotations

import torch

from layerswarm.training.data.datasets import Dataset

PALETTE = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 1.0, 0]])  # (4 classes, RGB)
CLASS_NAMES = ("r", "g", "b", "y")


def colour_images(labels: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """(N, 3, size, size) images: the label's colour at 0.6 plus uniform noise up to 0.4."""
    noise = torch.rand(len(labels), 3, size, size, generator=gen)
    return PALETTE[labels][:, :, None, None] * 0.6 + noise * 0.4


def colour_dataset(images: int, train: int, size: int = 32, seed: int = 0) -> Dataset:
    """`images` random-label images, the first `train` to train on and the rest to test on."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(CLASS_NAMES), (images,), generator=gen)
    x = colour_images(labels, size, gen)
    return Dataset("colours", "test", x[:train], labels[:train], x[train:], labels[train:], CLASS_NAMES)
