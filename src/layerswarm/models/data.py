"""Datasets, all local: a seeded generated image set, scikit-learn's bundled digits, and image folders.

A data spec names one:  shapes[:N_TRAIN[:N_TEST]] (pairs) | shapes1[...] (single shapes)  |  digits  |  imagefolder:PATH
Each yields float32 images (N, C, H, W) in [0, 1] and int64 labels; normalisation is the stem's job,
with mean and std saved in the model config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm"}


@dataclass
class Dataset:
    name: str
    spec: str
    train_x: torch.Tensor  # (N, C, H, W) float32 in [0, 1]
    train_y: torch.Tensor  # (N,) int64
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: tuple[str, ...]

    @property
    def image_shape(self) -> tuple[int, int, int]:
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)

    def describe(self) -> dict[str, object]:
        return {
            "spec": self.spec,
            "name": self.name,
            "train": len(self.train_y),
            "test": len(self.test_y),
            "classes": list(self.class_names),
            "image_shape": list(self.image_shape),
        }


def load_dataset(spec: str, seed: int = 0, image_size: int | None = None) -> Dataset:
    kind, _, arg = spec.partition(":")
    if kind in ("shapes", "shapes1"):
        mode = "pairs" if kind == "shapes" else "single"
        sizes = [int(s) for s in arg.split(":")] if arg else []
        n_train = sizes[0] if sizes else 20_000
        n_test = sizes[1] if len(sizes) > 1 else 2_000
        return make_shapes(n_train, n_test, seed=seed, spec=spec, mode=mode)
    if kind == "digits":
        return load_digits(spec, image_size or 32)
    if kind == "imagefolder":
        if not arg:
            raise ValueError("imagefolder needs a path: --data imagefolder:PATH")
        return load_imagefolder(Path(arg), spec, image_size or 32, seed=seed)
    raise ValueError(f"unknown data spec {spec!r}: use shapes[:N_TRAIN[:N_TEST]], digits or imagefolder:PATH")


# --- generated shapes -------------------------------------------------------------------------------

SHAPE_NAMES = ("disc", "square", "triangle", "plus", "ring", "diamond", "hbar", "vbar", "cross", "frame")


def _shape_mask(kind: int, size: int, grid: np.ndarray) -> np.ndarray:
    """Boolean (size, size) mask of one shape drawn in a box of side `size`."""
    yy, xx = grid
    c = (size - 1) / 2
    r = size / 2
    dy, dx = yy - c, xx - c
    t = max(1.0, size / 5)
    masks = {
        0: dy**2 + dx**2 <= r**2,
        1: np.ones_like(dy, dtype=bool),
        2: np.abs(dx) <= (yy + 1) / 2,  # apex at the top
        3: (np.abs(dy) < t) | (np.abs(dx) < t),
        4: (dy**2 + dx**2 <= r**2) & (dy**2 + dx**2 >= (r - t) ** 2),
        5: np.abs(dy) + np.abs(dx) <= r,
        6: np.abs(dy) < t,
        7: np.abs(dx) < t,
        8: (np.abs(dy - dx) < t) | (np.abs(dy + dx) < t),
        9: (np.abs(dy) > r - t - 0.5) | (np.abs(dx) > r - t - 0.5),
    }
    return masks[kind]


PAIR_KINDS = (0, 1, 2, 3)  # disc, square, triangle, plus
PAIRS = tuple((a, b) for a in PAIR_KINDS for b in PAIR_KINDS if a <= b)  # 10 unordered pairs


def make_shapes(
    n_train: int, n_test: int, seed: int = 0, spec: str = "shapes", size: int = 32, mode: str = "pairs"
) -> Dataset:
    """Generated shapes on dark, noisy backgrounds (bright shapes: contrast forced, so a tiny ViT learns).

    mode "single": the class is the one shape drawn (10 classes).
    mode "pairs": two shapes are drawn; the class is the unordered pair of their kinds (10 classes). The
    label needs two objects found in different patches and then combined: a composition of steps,
    which is what makes block order matter for a conventionally trained ViT.
    """
    rng = np.random.default_rng(seed)
    n = n_train + n_test
    images = np.empty((n, 3, size, size), dtype=np.float32)
    labels = rng.integers(0, 10, size=n)
    for i in range(n):
        label = int(labels[i])
        kinds = [label] if mode == "single" else list(PAIRS[label])
        images[i] = _draw_shapes(rng, kinds, size)
    names: tuple[str, ...]
    if mode == "single":
        names = SHAPE_NAMES
    else:
        names = tuple(f"{SHAPE_NAMES[a]}+{SHAPE_NAMES[b]}" for a, b in PAIRS)
    x = torch.from_numpy(images)
    y = torch.from_numpy(labels.astype(np.int64))
    return Dataset("shapes", spec, x[:n_train], y[:n_train], x[n_train:], y[n_train:], names)


def _draw_shapes(rng: np.random.Generator, kinds: list[int], size: int) -> np.ndarray:
    img = rng.uniform(0.0, 0.2, size=(3, 1, 1)) + rng.normal(0, 0.03, size=(3, size, size))
    half = size // 2
    # two shapes go to different halves (left/right or top/bottom) so they never overlap
    split_vertical = bool(rng.integers(0, 2))
    for slot, kind in enumerate(rng.permutation(kinds)):
        side = int(rng.integers(9, 15)) if len(kinds) > 1 else int(rng.integers(10, 20))
        grid = np.mgrid[0:side, 0:side]
        mask = _shape_mask(int(kind), side, grid)
        if len(kinds) == 1:
            top, left = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        else:
            lo_a, hi_a = (0, half - side) if slot == 0 else (half, size - side)
            a = int(rng.integers(lo_a, max(lo_a, hi_a) + 1))
            b = int(rng.integers(0, size - side + 1))
            top, left = (a, b) if split_vertical else (b, a)
        colour = rng.uniform(0.6, 1.0, size=3)
        img[:, top : top + side, left : left + side][:, mask] = colour[:, None]
    return np.clip(img, 0.0, 1.0).astype(np.float32)


# --- scikit-learn digits ------------------------------------------------------------------------------


def load_digits(spec: str, image_size: int) -> Dataset:
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = torch.from_numpy(bunch.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8)
    x = torch.nn.functional.interpolate(x, size=(image_size, image_size), mode="nearest").repeat(1, 3, 1, 1)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = len(y) // 5
    names = tuple(str(d) for d in range(10))
    return Dataset("digits", spec, x[n_test:], y[n_test:], x[:n_test], y[:n_test], names)


# --- image folders ------------------------------------------------------------------------------------


def decode_image(data: bytes | Path, image_size: int | None = None) -> np.ndarray:
    """Decode to float32 (3, H, W) in [0, 1] with Pillow (no torchvision on CPU-only machines)."""
    with Image.open(data if isinstance(data, Path) else _bytes_io(data)) as img:
        rgb = img.convert("RGB")
        if image_size is not None and rgb.size != (image_size, image_size):
            rgb = rgb.resize((image_size, image_size), Image.Resampling.BILINEAR)
        return np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0


def _bytes_io(data: bytes):  # type: ignore[no-untyped-def]
    import io

    return io.BytesIO(data)


def load_imagefolder(root: Path, spec: str, image_size: int, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """ImageNet-style layout: ROOT/<class>/<image>, or ROOT/train/<class>/... and ROOT/val/<class>/..."""
    if not root.is_dir():
        raise ValueError(f"imagefolder: {root} is not a directory")
    train_root, val_root = root / "train", root / "val"
    if train_root.is_dir() and val_root.is_dir():
        classes = _class_dirs(train_root)
        train_x, train_y = _read_folder(train_root, classes, image_size)
        test_x, test_y = _read_folder(val_root, classes, image_size)
    else:
        classes = _class_dirs(root)
        x, y = _read_folder(root, classes, image_size)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        n_test = max(1, int(len(y) * test_fraction))
        test_x, test_y, train_x, train_y = x[perm[:n_test]], y[perm[:n_test]], x[perm[n_test:]], y[perm[n_test:]]
    return Dataset("imagefolder", spec, train_x, train_y, test_x, test_y, tuple(classes))


def _class_dirs(root: Path) -> list[str]:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise ValueError(f"imagefolder: {root} needs at least two class subfolders, found {classes}")
    return classes


def _read_folder(root: Path, classes: list[str], image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    images: list[np.ndarray] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        folder = root / name
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
        for path in files:
            images.append(decode_image(path, image_size))
            labels.append(label)
    if not images:
        raise ValueError(f"imagefolder: no images under {root}")
    log.info("read %d images in %d classes from %s", len(images), len(classes), root)
    return torch.from_numpy(np.stack(images)), torch.tensor(labels, dtype=torch.int64)
