"""Image folders, as ImageNet and most tutorials lay them out, decoded at the model's size.

Accepted layouts (class = sub-folder name, classes sorted by name):

    ROOT/train/<class>/<image> with ROOT/val/, ROOT/validation/, ROOT/valid/ (Roboflow's exports) or
    ROOT/test/ beside it (same classes), the first of these found
    ROOT/train/<class>/<image> alone, or ROOT/<class>/<image>: one set, split by a seeded fraction

A class's images may sit in sub-folders of its folder (ROOT/<class>/2024/<image>), as torchvision's
ImageFolder finds them. Dot-names are skipped everywhere (.DS_Store, macOS's ._<image> resource forks,
.ipynb_checkpoints); other files without an image suffix are skipped with a warning that counts them.

A set whose decoded size (N x 3 x S x S float32) fits the memory limit is decoded once, by worker
processes, into memory; a larger one (ImageNet at 224 x 224 is hundreds of GB decoded) stays on disk
as an `ImageFiles` list and is decoded batch by batch while the model trains (DataLoader workers).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from layerswarm.models.images import IMAGE_SUFFIXES, decode_image

from .split import held_out_split

log = logging.getLogger(__name__)

DEFAULT_MEMORY_LIMIT_BYTES = 2 << 30
MUCH_LARGER = 4  # images this many times the training size a side, or more, get a warning
TEST_FOLDERS = ("val", "validation", "valid", "test")
LAYOUTS = (
    "ROOT/train/<class>/<image> with ROOT/val/, ROOT/validation/, ROOT/valid/ or ROOT/test/ beside it; "
    "ROOT/train/<class>/<image> alone; or ROOT/<class>/<image> (split by a seeded fraction); "
    f"images ending in {', '.join(sorted(IMAGE_SUFFIXES))}"
)
# What Pillow raises for a file it cannot open or decode (truncated data: OSError, SyntaxError or EOFError).
UNREADABLE = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)
Split = tuple["torch.Tensor | ImageFiles", torch.Tensor, "torch.Tensor | ImageFiles", torch.Tensor, tuple[str, ...]]


class ImageFiles(TorchDataset[torch.Tensor]):
    """Image files decoded on demand: indexing with a tensor or list of indices decodes that batch."""

    def __init__(self, paths: list[Path], image_size: int) -> None:
        self.paths, self.image_size = paths, image_size

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return len(self.paths), 3, self.image_size, self.image_size

    def __getitem__(self, index: int | torch.Tensor | list[int] | slice) -> torch.Tensor:
        """One image (3, S, S) for an int, else a batch (B, 3, S, S) decoded here."""
        if isinstance(index, int):
            return torch.from_numpy(self._decode(self.paths[index]))
        picked = self.paths[index] if isinstance(index, slice) else [self.paths[int(i)] for i in index]
        return torch.from_numpy(np.stack([self._decode(p) for p in picked]))

    def _decode(self, path: Path) -> np.ndarray:
        """One image; a file that cannot be decoded is a ValueError naming it (a header can be sound and
        the data truncated), also from a DataLoader worker."""
        try:
            return decode_image(path, self.image_size)
        except UNREADABLE as exc:
            raise unreadable(path, exc) from None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def subset(self, index: torch.Tensor) -> ImageFiles:
        return ImageFiles([self.paths[int(i)] for i in index], self.image_size)


def _split_folder(root: Path, names: tuple[str, ...]) -> Path | None:
    """The first of `names` that is a folder under root, in any case (Windows and macOS exports write
    Train/ and Val/, which a case-sensitive filesystem would otherwise take for two classes)."""
    by_name = {entry.name.lower(): Path(entry.path) for entry in sorted(os.scandir(root), key=lambda e: e.name)}
    folders = (by_name.get(name) for name in names)
    return next((folder for folder in folders if folder is not None and folder.is_dir()), None)


def load_imagefolder(
    root: Path,
    image_size: int,
    seed: int = 0,
    test_fraction: float = 0.2,
    workers: int = 0,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
) -> Split:
    """(train images, train labels, test images, test labels, class names) from a folder."""
    if not root.is_dir():
        raise ValueError(f"imagefolder: {root} is not a directory; accepted layouts: {LAYOUTS}")
    train_root = _split_folder(root, ("train",)) or root
    test_root = _split_folder(root, TEST_FOLDERS) if train_root != root else None
    classes = _class_dirs(train_root)
    train_paths, train_y, sizes = _list_folder(train_root, classes, every_class=True)
    warn_if_much_larger(root, sizes, image_size)
    if test_root is not None:
        _check_no_extra_classes(test_root, classes)
        test_paths, test_y, _ = _list_folder(test_root, classes, every_class=False)
    else:
        held, kept = held_out_split(train_y, max(1, int(len(train_y) * test_fraction)), seed)
        test_paths, test_y = [train_paths[int(i)] for i in held], train_y[held]
        train_paths, train_y = [train_paths[int(i)] for i in kept], train_y[kept]
    if len(train_y) < 2:
        raise ValueError(f"imagefolder: {train_root} has {len(train_y)} training image(s); at least 2 are needed")
    decoded_bytes = (len(train_paths) + len(test_paths)) * 3 * image_size * image_size * 4
    stream = decoded_bytes > memory_limit_bytes
    log.info(
        "imagefolder %s: %d train, %d test images in %d classes at %dx%d (%.0f MB decoded): %s",
        root,
        len(train_paths),
        len(test_paths),
        len(classes),
        image_size,
        image_size,
        decoded_bytes / 2**20,
        "streamed from disk" if stream else "held in memory",
    )
    train_files, test_files = ImageFiles(train_paths, image_size), ImageFiles(test_paths, image_size)
    if stream:
        return train_files, train_y, test_files, test_y, tuple(classes)
    return decode_all(train_files, workers), train_y, decode_all(test_files, workers), test_y, tuple(classes)


def usable_workers(asked: int) -> int:
    """Decoding processes: as many as asked, but no more than the cores this process may run on. More
    only queue for the same cores, and under `taskset` or a container's cpuset PyTorch warns about each
    loader made with more (twice per training run, in the user's log)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(asked, cores)


def decode_all(files: ImageFiles, workers: int, batch: int = 64) -> torch.Tensor:
    """Every file decoded into one tensor, by `workers` processes (0: in this one)."""
    chunks = [torch.arange(i, min(i + batch, len(files))) for i in range(0, len(files), batch)]
    if workers <= 0:
        return torch.cat([files[c] for c in chunks])
    loader = DataLoader(files, sampler=chunks, batch_size=None, num_workers=usable_workers(workers))
    return torch.cat(list(loader))


def _class_dirs(root: Path) -> list[str]:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not _hidden(p))
    if len(classes) < 2:
        raise ValueError(
            f"imagefolder: {root} needs at least two class sub-folders, found {classes}; accepted layouts: {LAYOUTS}"
        )
    return classes


def _hidden(path: Path) -> bool:
    """What file managers and tools leave beside images, never a class or an image: .DS_Store, macOS's
    ._<image> resource forks (not images, under an image suffix), .ipynb_checkpoints, .git."""
    return path.name.startswith(".")


def _list_folder(
    root: Path, classes: list[str], every_class: bool
) -> tuple[list[Path], torch.Tensor, list[tuple[int, int]]]:
    """The images of each class under root, labelled by the class's index in `classes`, and their sizes
    (width, height). every_class: a class folder without images is refused (training); else it is a
    warning (a test folder may lack one)."""
    paths: list[Path] = []
    labels: list[int] = []
    skipped: list[Path] = []
    missing: list[str] = []
    for label, name in enumerate(classes):
        folder = root / name
        files = _images_under(folder, skipped) if folder.is_dir() else []
        if not files:
            if every_class:
                raise ValueError(
                    f"imagefolder: class folder {folder} holds no images (a class the model could never learn); "
                    f"add images or remove the folder; images end in {', '.join(sorted(IMAGE_SUFFIXES))}"
                )
            missing.append(name)
        paths += files
        labels += [label] * len(files)
    if not paths:
        raise ValueError(f"imagefolder: no images under {root}; accepted layouts: {LAYOUTS}")
    if missing:
        log.warning("imagefolder: %s has no images of class(es) %s: test accuracy leaves them out", root, missing)
    if skipped:
        suffixes = sorted({p.suffix.lower() or p.name for p in skipped})
        log.warning(
            "imagefolder: %s: skipped %d file(s) that are not images by their suffix (%s), e.g. %s",
            root,
            len(skipped),
            ", ".join(suffixes[:8]),
            skipped[0],
        )
    sizes = check_headers(paths)
    return paths, torch.tensor(labels, dtype=torch.int64), sizes


def _images_under(folder: Path, skipped: list[Path]) -> list[Path]:
    """The image files in a class folder and its sub-folders, sorted (dot-names left out; other files
    without an image suffix added to `skipped`). A folder reached twice through symlinks, a loop among
    them included, is read once."""
    found: list[Path] = []
    seen: set[Path] = set()
    pending = [folder]
    while pending:
        current = pending.pop()
        real = current.resolve()
        if real in seen:
            continue
        seen.add(real)
        with os.scandir(current) as entries:  # is_dir from the directory entry: no stat per image file
            for entry in entries:
                path = Path(entry.path)
                if _hidden(path):
                    continue
                if entry.is_dir():
                    pending.append(path)
                elif path.suffix.lower() in IMAGE_SUFFIXES:
                    found.append(path)
                else:
                    skipped.append(path)
    return sorted(found)


def check_headers(paths: list[Path]) -> list[tuple[int, int]]:
    """Each image's (width, height), from its header; refuse, naming it, the first file whose header
    Pillow cannot read (an empty or corrupt file, or another format under an image suffix), before any
    decoding. Image.open reads the header only:
    about 0.15 ms a file on the 2-core development machine (page cache warm), minutes for ImageNet's
    1.28 M files. A truncated file with a sound header is named when it is decoded (ImageFiles)."""
    sizes: list[tuple[int, int]] = []
    for path in paths:
        try:
            with Image.open(path) as image:
                sizes.append(image.size)
        except UNREADABLE as exc:
            raise unreadable(path, exc) from None
    return sizes


def warn_if_much_larger(root: Path, sizes: list[tuple[int, int]], image_size: int) -> None:
    """Photos squeezed to a small training size lose the detail a task may need, and nothing said so
    (issue 46: trained at 32 x 32 without a word). Warn, naming the flag, when the training images' median
    shorter side is at least MUCH_LARGER times the size they are decoded at."""
    if not sizes:
        return
    width = int(np.median([w for w, _ in sizes]))
    height = int(np.median([h for _, h in sizes]))
    if min(width, height) >= MUCH_LARGER * image_size:
        log.warning(
            "imagefolder %s: the training images measure %dx%d (median of %d), at least %d times the "
            "%dx%d they are squeezed to, so fine detail is lost; from scratch, `layerswarm train "
            "--image-size S` sets the size the model takes (64, 96, ...; docs/own-data.md)",
            root,
            width,
            height,
            len(sizes),
            MUCH_LARGER,
            image_size,
            image_size,
        )


def unreadable(path: Path, exc: BaseException) -> ValueError:
    if isinstance(exc, UnidentifiedImageError):
        reason = "not an image Pillow can read (empty, corrupt, or another format under an image suffix)"
    else:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return ValueError(f"imagefolder: {path}: {reason}")


def _check_no_extra_classes(test_root: Path, classes: list[str]) -> None:
    extra = sorted(p.name for p in test_root.iterdir() if p.is_dir() and not _hidden(p) and p.name not in classes)
    if extra:
        raise ValueError(f"imagefolder: {test_root} has classes {extra} that the training folder lacks")
