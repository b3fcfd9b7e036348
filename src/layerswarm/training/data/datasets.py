"""Datasets, all local: a seeded generated image set, scikit-learn's bundled digits, and image folders.

A data spec names one:  shapes[:N_TRAIN[:N_TEST]] (pairs) | shapes1[...] (single shapes)  |  digits  |  imagefolder:PATH
Each yields float32 images (N, C, H, W) in [0, 1] at the model's image size and int64 labels;
normalisation is the stem's job, with mean and std saved in the model config. Generated sets are drawn
at 32 x 32 and resized; image folders are decoded at the size asked for (see models/images.py for the
policy), held in memory when they fit and streamed from disk otherwise (see folders.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from typing_extensions import Required, TypedDict

from layerswarm.models.images import IMAGE_SUFFIXES, decode_image, png_bytes

from .folders import DEFAULT_MEMORY_LIMIT_BYTES, ImageFiles, load_imagefolder, usable_workers

__all__ = ["IMAGE_SUFFIXES", "Dataset", "Images", "decode_image", "iterate_batches", "labelled_samples", "load_dataset"]

log = logging.getLogger(__name__)

NATIVE_SIZE = 32  # generated shapes and upsampled digits are drawn at this side
DATA_SPECS = (
    "shapes[:N_TRAIN[:N_TEST]], shapes1[:N_TRAIN[:N_TEST]], digits or imagefolder:PATH; "
    "text: words[:N_TRAIN[:N_TEST]], csv:PATH or jsonl:PATH"
)

Images = torch.Tensor | ImageFiles  # in memory, or decoded from disk batch by batch


class DataRecord(TypedDict, total=False):
    """What a data set says of itself (a manifest's `dataset`, an eval report's, a train state's check)."""

    spec: Required[str]
    name: Required[str]
    kind: str  # "text" for text data; images say nothing
    train: Required[int]
    test: Required[int]
    classes: Required[list[str]]
    image_shape: list[int]  # images: C, H, W
    streamed: bool  # images: decoded from disk batch by batch
    max_tokens: int  # text: the longest encoded sequence


@dataclass
class Dataset:
    name: str
    spec: str
    train_x: Images  # (N, C, H, W) float32 in [0, 1]
    train_y: torch.Tensor  # (N,) int64
    test_x: Images
    test_y: torch.Tensor
    class_names: tuple[str, ...]

    @property
    def image_shape(self) -> tuple[int, int, int]:
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)

    @property
    def streamed(self) -> bool:
        return isinstance(self.train_x, ImageFiles)

    def describe(self) -> DataRecord:
        return {
            "spec": self.spec,
            "name": self.name,
            "train": len(self.train_y),
            "test": len(self.test_y),
            "classes": list(self.class_names),
            "image_shape": list(self.image_shape),
            "streamed": self.streamed,
        }


def load_dataset(
    spec: str,
    seed: int = 0,
    image_size: int | None = None,
    workers: int = 0,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
) -> Dataset:
    """Load a data spec at `image_size` (None: the set's native 32 x 32).

    workers: decoding processes for image folders; memory_limit_bytes: larger decoded folders stream."""
    kind, _, arg = spec.partition(":")
    size = image_size or NATIVE_SIZE
    if kind in ("shapes", "shapes1"):
        n_train, n_test = parse_shape_counts(arg)
        data = make_shapes(n_train, n_test, seed=seed, spec=spec, mode="pairs" if kind == "shapes" else "single")
        return _resized(data, size)
    if kind == "digits":
        return load_digits(spec, size)
    if kind == "imagefolder":
        if not arg:
            raise ValueError("imagefolder needs a path: imagefolder:PATH")
        train_x, train_y, test_x, test_y, classes = load_imagefolder(
            Path(arg), size, seed=seed, workers=workers, memory_limit_bytes=memory_limit_bytes
        )
        # The absolute path in the spec: `family`, `eval` and `up` read it back from the manifest, from
        # any working directory (a relative one failed there, or named another folder of the same name).
        absolute = f"imagefolder:{os.path.abspath(arg)}"
        return Dataset("imagefolder", absolute, train_x, train_y, test_x, test_y, classes)
    raise ValueError(f"unknown data spec {spec!r}: use {DATA_SPECS}")


def parse_shape_counts(arg: str) -> tuple[int, int]:
    """The N_TRAIN[:N_TEST] of a shapes spec: whole numbers, at least 2 to train on and 1 to test."""
    parts = arg.split(":") if arg else []
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"shapes takes whole-number counts, shapes[:N_TRAIN[:N_TEST]], not {arg!r}")
    n_train = int(parts[0]) if parts else 20_000
    n_test = int(parts[1]) if len(parts) > 1 else 2_000
    if n_train < 2 or n_test < 1:
        raise ValueError(f"shapes needs at least 2 training and 1 test image, got {n_train} and {n_test}")
    return n_train, n_test


def check_spec(spec: str) -> str:
    """Check an image data spec without loading it (the command line's early, one-line error; text specs:
    training/text/data.py)."""
    kind, _, arg = spec.partition(":")
    if kind in ("shapes", "shapes1"):
        parse_shape_counts(arg)
    elif kind == "imagefolder":
        if not arg:
            raise ValueError("imagefolder needs a path: imagefolder:PATH")
        if not Path(arg).is_dir():
            raise ValueError(f"imagefolder: {arg} is not a directory")
    elif spec != "digits":
        raise ValueError(f"unknown data spec {spec!r}: use {DATA_SPECS}")
    return spec


def check_same_classes(
    model_classes: tuple[str, ...], data_classes: tuple[str, ...], model: str, hint: str = ""
) -> None:
    """Refuse data whose classes are not the model's, in its order: output i means model_classes[i], so
    other names (cat/dog/eel fine-tuned into a model of a/b/c served "a" for a cat) or another order (a
    folder with a class added or removed shifts every label after it) were trained or scored against the
    wrong outputs, silently. A model that names no classes (written before they were recorded) is not checked."""
    if model_classes and tuple(model_classes) != tuple(data_classes):
        raise ValueError(
            f"{model} has classes {list(model_classes)}, the data {list(data_classes)} (sorted folder names): "
            f"they must be the same, in the same order{hint}"
        )


def _resized(data: Dataset, size: int) -> Dataset:
    if size == NATIVE_SIZE:
        return data
    assert isinstance(data.train_x, torch.Tensor) and isinstance(data.test_x, torch.Tensor)
    data.train_x, data.test_x = resize_tensor(data.train_x, size), resize_tensor(data.test_x, size)
    return data


def resize_tensor(x: torch.Tensor, size: int) -> torch.Tensor:
    """(N, C, H, W) in [0, 1] to side `size`, bilinear (antialiased when shrinking), as images.py resizes."""
    return F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False).clamp(0, 1)


def iterate_batches(images: Images, index_batches: Sequence[torch.Tensor], workers: int = 0) -> Iterator[torch.Tensor]:
    """images[idx] for each idx; files are decoded by `workers` processes, a few batches ahead."""
    if isinstance(images, torch.Tensor) or workers <= 0:
        for idx in index_batches:
            yield images[idx]
        return
    loader = DataLoader(
        images, sampler=list(index_batches), batch_size=None, num_workers=usable_workers(workers), prefetch_factor=2
    )
    yield from loader


def with_test_noise(data: Dataset, std: float, seed: int = 1234) -> Dataset:
    """A harder held-back split: the test images plus seeded Gaussian noise (clipped to [0, 1])."""
    if not 0.0 < std <= 1.0:
        raise ValueError(f"test noise std {std} outside (0, 1]")
    if not isinstance(data.test_x, torch.Tensor):
        raise ValueError("test noise needs the test images in memory (this image folder streams from disk)")
    gen = torch.Generator().manual_seed(seed)
    noisy = (data.test_x + torch.randn(data.test_x.shape, generator=gen) * std).clamp(0.0, 1.0)
    spec = f"{data.spec}+noise{std:g}"
    return Dataset(data.name, spec, data.train_x, data.train_y, noisy, data.test_y, data.class_names)


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
    """8 x 8 digits upsampled (nearest: sharp strokes) to the model's side."""
    # scikit-learn is the optional `train` extra, needed only for this data set
    from sklearn.datasets import load_digits as sk_digits  # noqa: PLC0415

    bunch = sk_digits()
    x = torch.from_numpy(bunch.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8)
    x = torch.nn.functional.interpolate(x, size=(image_size, image_size), mode="nearest").repeat(1, 3, 1, 1)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = len(y) // 5
    names = tuple(str(d) for d in range(10))
    return Dataset("digits", spec, x[n_test:], y[n_test:], x[:n_test], y[:n_test], names)


# --- labelled samples for clients (samples, demos, load generators) -----------------------------------


def labelled_samples(
    dataset: dict[str, object], image_size: int, count: int, workers: int = 0
) -> list[tuple[bytes, str]]:
    """`count` test images of a model's dataset (its manifest's `dataset` record) as PNG bytes at the
    model's `image_size`, each with its class name: what a client sends, accepted without resize."""
    spec = str(dataset.get("spec", ""))
    if not spec:
        raise ValueError("the manifest names no dataset: pass a data spec")
    data = load_dataset(spec, seed=int(str(dataset.get("data_seed", 0))), image_size=image_size, workers=workers)
    n = min(count, len(data.test_y))
    images = data.test_x[torch.arange(n)]
    return [(png_bytes(images[i].numpy()), data.class_names[int(data.test_y[i])]) for i in range(n)]
