"""Datasets: generated data is deterministic; image folders load as ImageNet lays them out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from layerswarm.models.data import load_dataset


def test_shapes_are_deterministic_and_balanced() -> None:
    a, b = load_dataset("shapes:300:100", seed=3), load_dataset("shapes:300:100", seed=3)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert a.train_x.shape == (300, 3, 32, 32) and a.train_x.dtype == torch.float32
    assert float(a.train_x.min()) >= 0.0 and float(a.train_x.max()) <= 1.0
    assert len(a.class_names) == 10 and len(set(a.train_y.tolist())) == 10
    assert not torch.equal(load_dataset("shapes:300:100", seed=4).train_x, a.train_x)


def test_digits_bundled_with_scikit_learn() -> None:
    d = load_dataset("digits")
    assert d.train_x.shape[1:] == (3, 32, 32) and len(d.class_names) == 10
    assert len(d.train_y) + len(d.test_y) == 1797


def _write_folder(root: Path, classes: dict[str, tuple[int, int, int]], per_class: int) -> None:
    rng = np.random.default_rng(0)
    for name, colour in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.clip(np.array(colour) + rng.integers(-20, 20, size=(20, 24, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def test_imagefolder_split_and_resize(tmp_path: Path) -> None:
    _write_folder(tmp_path, {"red": (200, 20, 20), "blue": (20, 20, 200), "green": (20, 200, 20)}, 10)
    d = load_dataset(f"imagefolder:{tmp_path}")
    assert d.class_names == ("blue", "green", "red")
    assert d.train_x.shape[1:] == (3, 32, 32) and len(d.train_y) + len(d.test_y) == 30
    red = d.class_names.index("red")
    sample = d.train_x[d.train_y == red][0]
    assert float(sample[0].mean()) > float(sample[2].mean())  # channel order kept (RGB)


def test_imagefolder_train_val_layout(tmp_path: Path) -> None:
    _write_folder(tmp_path / "train", {"a": (0, 0, 0), "b": (255, 255, 255)}, 4)
    _write_folder(tmp_path / "val", {"a": (0, 0, 0), "b": (255, 255, 255)}, 2)
    d = load_dataset(f"imagefolder:{tmp_path}")
    assert len(d.train_y) == 8 and len(d.test_y) == 4


def test_bad_specs_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown data spec"):
        load_dataset("cifar")
    with pytest.raises(ValueError, match="not a directory"):
        load_dataset(f"imagefolder:{tmp_path / 'none'}")
    (tmp_path / "only").mkdir()
    with pytest.raises(ValueError, match="two class subfolders"):
        load_dataset(f"imagefolder:{tmp_path}")
