"""Datasets: generated data is deterministic; image folders load as ImageNet lays them out, at any size."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from layerswarm.training.data.datasets import check_spec, iterate_batches, load_dataset
from layerswarm.training.data.folders import ImageFiles, usable_workers


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
    with pytest.raises(ValueError, match=r"two class sub-folders.*accepted layouts: ROOT/train/<class>"):
        load_dataset(f"imagefolder:{tmp_path}")


def test_an_unreadable_image_is_named_when_the_folder_is_scanned(tmp_path: Path) -> None:
    _write_folder(tmp_path, {"a": (0, 0, 0), "b": (255, 255, 255)}, 2)
    broken = tmp_path / "b" / "broken.png"
    broken.write_bytes(b"not a PNG at all")
    with pytest.raises(ValueError, match=re.escape(f"imagefolder: {broken}: not an image Pillow can read")):
        load_dataset(f"imagefolder:{tmp_path}", memory_limit_bytes=0)  # streamed: nothing is decoded up front


@pytest.mark.parametrize("test_folder", ["val", "validation", "valid", "test"])
def test_imagefolder_accepts_each_common_test_folder_name(tmp_path: Path, test_folder: str) -> None:
    _write_folder(tmp_path / "train", {"a": (0, 0, 0), "b": (255, 255, 255)}, 3)
    _write_folder(tmp_path / test_folder, {"a": (0, 0, 0), "b": (255, 255, 255)}, 2)
    d = load_dataset(f"imagefolder:{tmp_path}")
    assert (len(d.train_y), len(d.test_y)) == (6, 4) and d.class_names == ("a", "b")


@pytest.mark.parametrize(("train", "test"), [("Train", "Val"), ("TRAIN", "Test"), ("train", "Validation")])
def test_imagefolder_split_folders_in_any_case(tmp_path: Path, train: str, test: str) -> None:
    """Exports from Windows and macOS write Train/ and Val/: not two classes named so."""
    _write_folder(tmp_path / train, {"a": (0, 0, 0), "b": (255, 255, 255)}, 3)
    _write_folder(tmp_path / test, {"a": (0, 0, 0), "b": (255, 255, 255)}, 2)
    d = load_dataset(f"imagefolder:{tmp_path}")
    assert (len(d.train_y), len(d.test_y)) == (6, 4) and d.class_names == ("a", "b")


def test_imagefolder_train_alone_is_split_by_seed(tmp_path: Path) -> None:
    _write_folder(tmp_path / "train", {"a": (0, 0, 0), "b": (255, 255, 255)}, 10)
    one, same, other = (load_dataset(f"imagefolder:{tmp_path}", seed=s) for s in (1, 1, 2))
    assert len(one.test_y) == 4 and len(one.train_y) == 16
    assert torch.equal(one.test_x, same.test_x) and not torch.equal(one.test_x, other.test_x)


def test_imagefolder_val_class_unknown_to_train_is_refused(tmp_path: Path) -> None:
    _write_folder(tmp_path / "train", {"a": (0, 0, 0), "b": (255, 255, 255)}, 2)
    _write_folder(tmp_path / "val", {"a": (0, 0, 0), "zebra": (255, 255, 255)}, 1)
    with pytest.raises(ValueError, match=r"\['zebra'\]"):
        load_dataset(f"imagefolder:{tmp_path}")


@pytest.mark.parametrize("size", [16, 48, 64])
def test_every_spec_loads_at_the_asked_image_size(tmp_path: Path, size: int) -> None:
    _write_folder(tmp_path, {"a": (10, 10, 10), "b": (240, 240, 240)}, 3)
    for spec in ("shapes1:8:4", "digits", f"imagefolder:{tmp_path}"):
        d = load_dataset(spec, image_size=size)
        assert d.image_shape == (3, size, size), spec
        assert d.test_x.shape[1:] == (3, size, size), spec
        assert float(d.train_x.min()) >= 0.0 and float(d.train_x.max()) <= 1.0, spec


def test_imagefolder_resize_policy_is_the_whole_image_squeezed(tmp_path: Path) -> None:
    """No crop: a 40 x 20 image, left half red and right half blue, keeps both halves at 8 x 8."""
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[:, :20, 0], pixels[:, 20:, 2] = 255, 255
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        Image.fromarray(pixels).save(tmp_path / name / "0.png")
        Image.fromarray(pixels).save(tmp_path / name / "1.png")
    image = load_dataset(f"imagefolder:{tmp_path}", image_size=8).train_x[0]
    assert float(image[0, :, :3].min()) > 0.9 and float(image[2, :, :3].max()) < 0.1  # left: red
    assert float(image[2, :, -3:].min()) > 0.9 and float(image[0, :, -3:].max()) < 0.1  # right: blue


def test_streamed_folder_decodes_in_workers_to_the_same_images(tmp_path: Path) -> None:
    _write_folder(tmp_path, {"a": (200, 20, 20), "b": (20, 20, 200)}, 6)
    held = load_dataset(f"imagefolder:{tmp_path}", image_size=24)
    streamed = load_dataset(f"imagefolder:{tmp_path}", image_size=24, workers=2, memory_limit_bytes=0)
    assert not held.streamed and streamed.streamed and streamed.describe()["streamed"] is True
    assert isinstance(streamed.train_x, ImageFiles) and streamed.train_x.shape == (10, 3, 24, 24)
    idx = [torch.tensor([0, 3, 5]), torch.tensor([8, 1])]
    for got, want in zip(
        iterate_batches(streamed.train_x, idx, workers=2), (held.train_x[i] for i in idx), strict=True
    ):
        assert torch.equal(got, want)
    assert torch.equal(torch.stack(list(streamed.test_x)), held.test_x)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_decoding_workers_never_outnumber_the_cores_this_process_may_use(tmp_path: Path) -> None:
    """Pinned to one core (taskset, a container's cpuset), two workers asked: PyTorch warned twice per
    training run that they outnumber the cores; now the loaders get one."""
    _write_folder(tmp_path, {"a": (200, 20, 20), "b": (20, 20, 200)}, 6)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        assert usable_workers(2) == 1 and usable_workers(0) == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the worker-count warning would fail the test
            held = load_dataset(f"imagefolder:{tmp_path}", image_size=24, workers=2)
            streamed = load_dataset(f"imagefolder:{tmp_path}", image_size=24, workers=2, memory_limit_bytes=0)
            batches = list(iterate_batches(streamed.train_x, [torch.arange(4)], workers=2))
    finally:
        os.sched_setaffinity(0, allowed)
    assert torch.equal(batches[0], held.train_x[:4])


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("shapes:abc", "whole-number counts"),
        ("shapes:0:0", "at least 2 training and 1 test"),
        ("shapes1:5:0", "at least 2 training and 1 test"),
        ("shapes:1:2:3", "whole-number counts"),
        ("imagefolder:", "needs a path"),
    ],
)
def test_bad_shape_counts_are_explained(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        load_dataset(spec)
    with pytest.raises(ValueError, match=problem):
        check_spec(spec)


@pytest.mark.parametrize("suffix", [".png", ".pgm"])
def test_sixteen_bit_grey_is_scaled_not_clipped_to_white(tmp_path: Path, suffix: str) -> None:
    """A 16-bit grey ramp (PNG opens as I;16, PGM as I) decodes to the 8-bit ramp it is, for training and at
    the coordinator alike: Pillow's own convert("RGB") turned every sample above 255 white."""
    from layerswarm.coordinator.http.imaging import decode as coordinator_decode

    ramp = np.arange(256, dtype=np.uint16).reshape(16, 16) * 257  # 0..65535: the 8-bit ramp at full scale
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i in range(2):
            Image.fromarray(ramp).save(tmp_path / name / f"{i}{suffix}")
    expected = np.repeat((np.arange(256, dtype=np.float32).reshape(1, 16, 16) / 255.0), 3, axis=0)
    image = load_dataset(f"imagefolder:{tmp_path}", image_size=16).train_x[0].numpy()
    assert np.allclose(image, expected, atol=1e-6)
    served = coordinator_decode((tmp_path / "a" / f"0{suffix}").read_bytes(), 16, max_pixels=1 << 20)
    assert np.allclose(served, expected, atol=1e-6)  # PGM too: a folder of them trains, so they are served


def test_imagefolder_finds_images_in_sub_folders_of_a_class(tmp_path: Path) -> None:
    """ROOT/<class>/<year>/<image>, as photos are often sorted: the class keeps its images (it was left with
    none, silently, and the model had a class it never saw)."""
    _write_folder(tmp_path / "a", {"2024": (0, 0, 0), "2025": (10, 10, 10)}, 3)
    _write_folder(tmp_path, {"b": (255, 255, 255)}, 6)
    d = load_dataset(f"imagefolder:{tmp_path}")
    assert d.class_names == ("a", "b")
    labels = torch.cat([d.train_y, d.test_y])
    assert torch.bincount(labels).tolist() == [6, 6]


def test_imagefolder_skips_what_file_managers_leave_beside_images(tmp_path: Path) -> None:
    """macOS's ._<image> resource forks (under an image suffix), .DS_Store, Thumbs.db, notes and hidden
    folders (.ipynb_checkpoints in val/ too) are not images or classes: no error, nothing counted."""
    _write_folder(tmp_path / "train", {"a": (0, 0, 0), "b": (255, 255, 255)}, 3)
    _write_folder(tmp_path / "val", {"a": (0, 0, 0), "b": (255, 255, 255)}, 2)
    (tmp_path / "train" / "a" / "._0.png").write_bytes(b"\x00\x05\x16\x07Mac OS X        ")
    (tmp_path / "train" / "a" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (tmp_path / "train" / "b" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (tmp_path / "train" / "b" / "notes.txt").write_text("from the field trip")
    for hidden in (tmp_path / "train" / ".ipynb_checkpoints", tmp_path / "val" / ".ipynb_checkpoints"):
        hidden.mkdir()
        Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(hidden / "0.png")
    d = load_dataset(f"imagefolder:{tmp_path}")
    assert d.class_names == ("a", "b") and (len(d.train_y), len(d.test_y)) == (6, 4)


def test_imagefolder_class_without_images_is_refused_naming_it(tmp_path: Path) -> None:
    _write_folder(tmp_path, {"a": (0, 0, 0), "b": (255, 255, 255)}, 3)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "readme.txt").write_text("to do")
    with pytest.raises(ValueError, match=re.escape(f"class folder {tmp_path / 'c'} holds no images")):
        load_dataset(f"imagefolder:{tmp_path}")


def test_imagefolder_test_folder_missing_a_class_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write_folder(tmp_path / "train", {"a": (0, 0, 0), "b": (255, 255, 255), "c": (0, 0, 255)}, 3)
    _write_folder(tmp_path / "val", {"a": (0, 0, 0), "c": (0, 0, 255)}, 2)
    d = load_dataset(f"imagefolder:{tmp_path}")
    assert d.class_names == ("a", "b", "c") and d.test_y.tolist() == [0, 0, 2, 2]  # val's c keeps its label
    assert "has no images of class(es) ['b']" in caplog.text


def test_imagefolder_symlink_loop_is_read_once(tmp_path: Path) -> None:
    _write_folder(tmp_path, {"a": (0, 0, 0), "b": (255, 255, 255)}, 3)
    (tmp_path / "a" / "again").symlink_to(tmp_path / "a", target_is_directory=True)
    d = load_dataset(f"imagefolder:{tmp_path}")
    assert len(d.train_y) + len(d.test_y) == 6


def test_a_class_of_one_image_is_never_split_away_from_training(tmp_path: Path) -> None:
    """Very unequal classes: with seed 5 the random 20% test split drew the one "tiny" image (and the
    trainer's 10% validation split can draw it again), leaving a class never trained on, silently. It goes
    back to training; a split in which every class keeps an image is the plain permutation's, unchanged."""
    from layerswarm.training.data.split import held_out_split

    _write_folder(tmp_path, {"big": (0, 0, 0), "small": (128, 128, 128)}, 12)
    _write_folder(tmp_path, {"tiny": (255, 255, 255)}, 1)
    for seed in range(6):
        d = load_dataset(f"imagefolder:{tmp_path}", seed=seed)
        assert torch.bincount(d.train_y, minlength=3).tolist()[2] == 1, seed
        assert len(d.test_y) >= 1
    labels = torch.tensor([0] * 40 + [1] * 40 + [2])
    for seed in range(20):
        held, kept = held_out_split(labels, 9, seed)
        assert 2 in labels[kept].tolist() and len(held) + len(kept) == 81, seed
        assert sorted(torch.cat([held, kept]).tolist()) == list(range(81))
    balanced = torch.arange(100) % 4
    held, kept = held_out_split(balanced, 10, 5)
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(5))
    assert torch.equal(held, perm[:10]) and torch.equal(kept, perm[10:])
