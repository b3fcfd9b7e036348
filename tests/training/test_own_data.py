"""A user's own data: generated image-folder tasks, flips off by default, and the honest report of
what a trained ViT learned against chance and a reference CNN trained for the same time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from layerswarm.cli import main
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.config import patch_size_for
from layerswarm.training.data.datasets import load_dataset
from layerswarm.training.data.synthetic import (
    COMPARE_CLASSES,
    PALETTE,
    RELATION_CLASSES,
    RELATIONS,
    TASKS,
    _relation_centres,
    compare_shapes,
    image,
    write,
)
from layerswarm.training.family import inherited_augmentation
from layerswarm.training.objective import augment
from layerswarm.training.recipe import from_scratch_time_budget
from layerswarm.training.reference import ReferenceResult, compare, far_behind_warning, train_reference
from layerswarm.training.runs import image_time_budget
from layerswarm.training.train import TrainRecipe

from ..colour_data import colour_dataset


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generated_tasks_are_deterministic_balanced_and_read_as_image_folders(task: str, tmp_path: Path) -> None:
    write(task, tmp_path / "a", train=24, val=8, seed=3)
    write(task, tmp_path / "b", train=24, val=8, seed=3)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.png"))
    assert len(files) == 32
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    data = load_dataset(f"imagefolder:{tmp_path / 'a'}", seed=0)
    assert data.class_names == tuple(sorted(TASKS[task].classes)) and len(data.train_y) == 24
    assert torch.bincount(data.train_y).tolist() == [3] * 8  # balanced: chance is 1/8
    other, _ = image(task, 4, "train", 0)
    assert np.asarray(other).tobytes() != np.asarray(image(task, 3, "train", 0)[0]).tobytes()


def test_the_cli_offers_every_generated_task() -> None:
    """`layerswarm datasets` keeps its own list (its module stays torch- and numpy-free): it must not drift."""
    from layerswarm.cli.datasets import TASKS as OFFERED

    assert sorted(OFFERED) == sorted(TASKS)


def test_faint_textures_are_the_textures_classes_at_lower_contrast() -> None:
    """The harder variant keeps the eight classes, its pattern at a fraction of `textures`' contrast
    (with the tilt and the wider periods, what keeps it off the ceiling)."""
    assert TASKS["faint-textures"].classes == TASKS["textures"].classes

    def spread(task: str) -> float:  # spatial std per colour channel: the pattern's contrast plus noise
        pixels = [np.asarray(image(task, 0, "train", i)[0], dtype=np.float64) for i in range(64)]
        return float(np.mean([p.std(axis=(0, 1)).mean() for p in pixels]))

    assert spread("faint-textures") < 0.65 * spread("textures")  # 20.5 against 36.3


def test_relation_labels_follow_the_geometry_and_a_mirror_swaps_left_and_right() -> None:
    """Why flips are off by default: the circle of a 'left' image is left of the square; mirrored
    (x -> 31 - x) it is right of it, which is another class."""
    for seed in range(50):
        rng = np.random.default_rng(seed)
        for relation in RELATIONS:
            (cx, cy), (sx, sy) = _relation_centres(rng, relation)
            gap = {"left": sx - cx, "right": cx - sx, "above": sy - cy, "below": cy - sy}[relation]
            assert gap >= 8, (relation, gap)  # a clear margin: the label is never ambiguous
            mirrored_gap = {"left": (31 - cx) - (31 - sx), "right": (31 - sx) - (31 - cx)}.get(relation)
            if mirrored_gap is not None:
                assert mirrored_gap > 0  # in the mirror image the relation is the opposite one
    assert {c.split("-")[1] for c in RELATION_CLASSES} == set(RELATIONS)


def test_compare_labels_say_which_of_shape_colour_and_size_agree_and_the_pixels_show_it() -> None:
    """Each class name is three verdicts; the two objects drawn must agree exactly where it says
    "same" and differ where it says "diff", sit apart, and be painted where the generator put them
    (a triangle leaves its bounding box's corner to the background, a square fills it)."""
    for label, name in enumerate(COMPARE_CLASSES):
        verdicts = dict(part.split("-") for part in name.split("_"))
        for index in range(40):
            rng = np.random.default_rng([0, 0, index])
            a, b = compare_shapes(rng, label)
            pairs = {"shape": (a.kind, b.kind), "colour": (a.colour, b.colour), "size": (a.radius, b.radius)}
            for what, (x, y) in pairs.items():
                assert (x == y) == (verdicts[what] == "same"), (name, what, x, y)
            gap = max(abs(a.centre[0] - b.centre[0]), abs(a.centre[1] - b.centre[1])) - a.radius - b.radius
            assert gap >= 4
    for index in range(64):
        img, label = image("compare", 0, "train", index)
        pixels = np.asarray(img, dtype=np.int64)
        a, b = compare_shapes(np.random.default_rng([0, 0, index]), label)
        for shape in (a, b):
            (x, y), r = shape.centre, shape.radius
            assert np.abs(pixels[y, x] - PALETTE[shape.colour]).max() <= 12  # the palette colour, jittered
            corner_painted = np.array_equal(pixels[y - r, x - r], pixels[y, x])
            assert corner_painted == (shape.kind == "square")


def test_flips_are_off_by_default_and_on_when_asked() -> None:
    assert TrainRecipe().hflip is False
    images = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    padded = F.pad(images, (2, 2, 2, 2))
    shifts = [padded[..., dy : dy + 4, dx : dx + 4] for dy in range(5) for dx in range(5)]  # zero-filled moves
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):  # never a mirror image without hflip: only each image moved by a few pixels
        out = augment(images, gen, hflip=False)
        assert all(any(torch.equal(out[i], s[i]) for s in shifts) for i in range(2))
    outputs = [augment(images, gen, hflip=True)[0] for _ in range(20)]
    flipped = [not any(torch.equal(out, s[0]) for s in shifts) for out in outputs]  # a move of the mirror image
    assert any(flipped)


def test_reference_cnn_learns_and_the_far_behind_warning_fires(tmp_path: Path) -> None:
    data = colour_dataset(384, train=256, size=16)
    result = train_reference((data.train_x, data.train_y), (data.test_x, data.test_y), 4, budget_s=3.0)
    assert result.val_acc > 0.9 and result.steps > 0
    warning = far_behind_warning({"val_sequential": 0.5}, result)
    assert warning and "below 90% of a small CNN" in warning
    assert far_behind_warning({"val_sequential": result.val_acc}, result) is None
    fake = ReferenceResult("cnn", 0.5, 1.0, 1, 0.1)
    assert far_behind_warning({"val_sequential": 0.46}, fake) is None  # 0.92 of the reference: not far behind


def test_a_reference_that_learned_nothing_gives_no_ratio() -> None:
    """A ratio to a zero accuracy said 1e9 in the manifest; now it says nothing."""
    record = compare({"val_sequential": 0.4}, ReferenceResult("cnn", 0.0, 1.0, 1, 0.1), 8)
    assert record["ratio_val_sequential"] is None and record["vit_val_sequential"] == 0.4
    assert compare({"val_sequential": 0.4}, ReferenceResult("cnn", 0.5, 1.0, 1, 0.1), 8)["ratio_val_sequential"] == 0.8


def test_train_reports_chance_and_reference_in_the_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write("textures", tmp_path / "data", train=160, val=40)
    argv = ["train", "--data", f"imagefolder:{tmp_path / 'data'}", "--out", str(tmp_path / "m"), "--epochs", "1"]
    argv += ["--depth", "2", "--dim", "16", "--heads", "2", "--reference-seconds", "1", "--workers", "0"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "reference CNN" in err and "chance 0.125" in err
    manifest = read_manifest(tmp_path / "m")
    learned = manifest.metrics["learned"]
    assert learned["chance"] == 0.125 and 0 <= learned["reference"]["val_acc"] <= 1
    assert 0 <= learned["majority_baseline"] <= 1  # always answering the most common class, beside chance
    assert {"vit_val_sequential", "vit_val_arbitrary", "ratio_val_sequential"} <= set(learned)
    assert manifest.recipe["hflip"] is False
    assert manifest.config.stem == "conv" and manifest.config.patch_size == 8  # from 32 x 32, for a conv stem
    recipe = manifest.recipe
    assert recipe["stem"] == "conv" and recipe["label_smoothing"] > 0 and recipe["patience"] > 0
    assert recipe["time_budget_s"] == 600.0  # 160 images from scratch: the short end of the data-derived budget
    assert recipe["size"]["size_inputs"]["time_budget_s"] == 600.0  # what --size auto was told
    assert "stopped" in recipe and recipe["history"][-1]["planned_steps"] >= 1
    json.dumps(learned)  # plain JSON in the manifest


def test_the_default_time_budget_grows_with_the_images_up_to_fifteen_minutes() -> None:
    budgets = [from_scratch_time_budget(n) for n in (1, 800, 4_000, 6_000, 10_000, 15_000, 20_000, 10**6)]
    assert budgets[:3] == [600.0, 600.0, 600.0] and budgets[-2:] == [900.0, 900.0]
    assert budgets == sorted(budgets) and 600 < budgets[3] < budgets[4] < budgets[5] < 900
    assert budgets[4] == 771.0  # 10,000 images: 600 + 300 x log(2.5) / log(5), along the log of the count


def test_an_asked_time_budget_wins_and_a_fine_tune_keeps_the_short_one() -> None:
    assert image_time_budget(None, None, 20_000) == 900.0
    assert image_time_budget(None, None, 4_000) == 600.0
    assert image_time_budget(120.0, None, 20_000) == 120.0  # the command line's, whatever the data
    assert image_time_budget(None, "models/base", 20_000) == TrainRecipe.time_budget_s == 600.0
    # --resume without --time-budget goes on with the budget its run started with, not today's default
    assert image_time_budget(None, None, 20_000, saved=600.0) == 600.0
    assert image_time_budget(300.0, None, 20_000, saved=600.0) == 300.0  # asked: then the refusal names it


def test_family_members_inherit_the_bases_augmentation() -> None:
    assert inherited_augmentation({"augment": True, "hflip": False}) == []
    assert inherited_augmentation({"augment": True, "hflip": True}) == ["--hflip"]
    assert inherited_augmentation({"augment": False, "hflip": True}) == ["--no-augment"]
    assert inherited_augmentation({"augment": True}) == ["--hflip"]  # recorded before hflip existed: it flipped
    assert inherited_augmentation({"augment": True, "hflip": False, "drop_path": 0.1}) == ["--drop-path", "0.1"]


def test_patch_size_follows_the_image_size() -> None:
    assert [patch_size_for(s) for s in (16, 28, 32, 64, 224, 7)] == [2, 4, 4, 8, 16, 1]
    assert [patch_size_for(s, "conv") for s in (16, 28, 32, 64, 224, 7)] == [4, 4, 8, 16, 16, 1]


def test_datasets_command_writes_a_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["datasets", "counting", str(tmp_path / "c"), "--train", "16", "--val", "8"]) == 0
    assert "16 training and 8 validation images of counting" in capsys.readouterr().out
    assert len(list((tmp_path / "c" / "train").rglob("*.png"))) == 16
    assert Image.open(next((tmp_path / "c" / "val").rglob("*.png"))).size == (32, 32)


def test_own_data_summary_reads_what_a_default_run_leaves(tmp_path: Path) -> None:
    """bench/own_data.py: the README's own-data table from the folders scripts/own_data_check.sh writes."""
    from layerswarm.bench.own_data import render, summarize

    run = tmp_path / "work" / "relations-64"
    assert main(["datasets", "relations", str(run / "data"), "--train", "64", "--val", "32"]) == 0
    train = ["train", "--data", f"imagefolder:{run / 'data'}", "--out", str(run / "base"), "--epochs", "2"]
    assert main([*train, "--time-budget", "5", "--reference-seconds", "2", "--dim", "16", "--depth", "2"]) == 0
    (run / "times.json").write_text(json.dumps({"task": "relations", "train_images": 64, "base_s": 9}))
    summary = summarize(tmp_path / "work")
    (row,) = summary["rows"]
    learned = read_manifest(run / "base").metrics["learned"]
    assert row["task"] == "relations" and row["train_images"] == 64 and row["epochs"] == 2
    assert row["ratio_sequential"] == learned["ratio_val_sequential"]
    ratio = learned["ratio_val_sequential"]  # None when the reference learned nothing (6 images to score it)
    assert row["met"] == (ratio is None or ratio >= 0.9)
    assert "| relations | 64 |" in render(summary) and "family" not in row


def _folder(root: Path, classes: tuple[str, ...], per_class: int = 6) -> None:
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, size=(16, 16, 3), dtype=np.uint8)).save(root / name / f"{i}.png")


def test_a_model_reads_its_folder_back_from_anywhere_and_refuses_other_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest names the folder by its absolute path (`family`, `eval` and `up` read it back from any
    working directory; a relative one failed there, or named another folder), and a fine-tune or an eval on
    folders whose classes are not the model's, in its order, is refused (the labels were silently the
    model's: a fine-tune on cat/dog served "a"/"b")."""
    _folder(tmp_path / "work" / "photos", ("a", "b"))
    _folder(tmp_path / "other", ("cat", "dog"))
    monkeypatch.chdir(tmp_path / "work")
    tiny = ["--epochs", "1", "--depth", "1", "--dim", "16", "--heads", "2", "--no-reference", "--workers", "0"]
    assert main(["train", "--data", "imagefolder:photos", "--out", "m", "--image-size", "16", *tiny]) == 0
    manifest = read_manifest(tmp_path / "work" / "m")
    assert manifest.dataset["spec"] == f"imagefolder:{tmp_path / 'work' / 'photos'}"
    monkeypatch.chdir(tmp_path)
    assert load_dataset(str(manifest.dataset["spec"]), image_size=16).class_names == ("a", "b")
    capsys.readouterr()
    other = f"imagefolder:{tmp_path / 'other'}"
    assert main(["train", "--data", other, "--init", "work/m", "--out", "ft", *tiny]) == 2
    err = capsys.readouterr().err
    assert "--init work/m has classes ['a', 'b'], the data ['cat', 'dog']" in err and "Traceback" not in err, err
    assert main(["eval", "work/m", "--data", other, "--workers", "0"]) == 2
    assert "work/m has classes ['a', 'b'], the data ['cat', 'dog']" in capsys.readouterr().err


def test_a_fine_tunes_reference_trains_as_long_as_its_lineage_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fine-tuned ViT is its base's training plus its own: its reference CNN gets both, or a family member
    fine-tuned for a second was reported far ahead of a CNN trained for that second."""
    _folder(tmp_path / "photos", ("a", "b"), per_class=16)
    tiny = ["--data", f"imagefolder:{tmp_path / 'photos'}", "--image-size", "16", "--workers", "0"]
    tiny += ["--depth", "1", "--dim", "16", "--heads", "2", "--patience", "0"]
    assert main(["train", *tiny, "--epochs", "30", "--no-reference", "--out", str(tmp_path / "base")]) == 0
    base = read_manifest(tmp_path / "base").recipe["training_seconds_total"]
    assert base > 0
    assert main(["train", *tiny, "--epochs", "1", "--init", str(tmp_path / "base"), "--out", str(tmp_path / "m")]) == 0
    member = read_manifest(tmp_path / "m")
    assert member.recipe["training_seconds_total"] >= base
    assert member.metrics["learned"]["reference"]["seconds"] >= 0.9 * base  # not the member's own second


def test_a_member_without_its_own_reference_is_compared_with_its_bases(tmp_path: Path) -> None:
    """Family members skip training a reference CNN (`--no-reference`, as `layerswarm family` passes):
    they are still reported against chance and a reference, the one their base was compared with."""
    _folder(tmp_path / "photos", ("a", "b"), per_class=16)
    tiny = ["--data", f"imagefolder:{tmp_path / 'photos'}", "--image-size", "16", "--workers", "0"]
    tiny += ["--depth", "1", "--dim", "16", "--heads", "2", "--patience", "0"]
    assert main(["train", *tiny, "--epochs", "3", "--reference-seconds", "1", "--out", str(tmp_path / "base")]) == 0
    base = read_manifest(tmp_path / "base").metrics["learned"]
    member_args = ["--epochs", "1", "--init", str(tmp_path / "base"), "--no-reference", "--out", str(tmp_path / "m")]
    assert main(["train", *tiny, *member_args]) == 0
    learned = read_manifest(tmp_path / "m").metrics["learned"]
    assert learned["reference"] == base["reference"] and learned["reference_from"] == str(tmp_path / "base")
    assert learned["chance"] == 0.5 and {"vit_val_sequential", "vit_val_arbitrary", "ratio_val_arbitrary"} <= set(
        learned
    )
    assert main(["train", *tiny, "--epochs", "1", "--no-reference", "--out", str(tmp_path / "scratch")]) == 0
    assert "learned" not in read_manifest(tmp_path / "scratch").metrics  # nothing inherited, nothing claimed


def test_a_screen_without_a_reference_gets_one_on_its_own_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench/reference_cnn.py: the CNN `train --no-reference` skipped, on the run's split, against its kept epoch."""
    from layerswarm.bench.reference_cnn import main as reference_main

    write("textures", tmp_path / "data", train=96, val=16)
    argv = ["train", "--data", f"imagefolder:{tmp_path / 'data'}", "--out", str(tmp_path / "m"), "--epochs", "1"]
    assert main([*argv, "--depth", "2", "--dim", "16", "--heads", "2", "--no-reference", "--workers", "0"]) == 0
    assert "learned" not in read_manifest(tmp_path / "m").metrics
    assert reference_main([str(tmp_path / "m"), "--seconds", "1", "--json", str(tmp_path / "r.json")]) == 0
    record = json.loads((tmp_path / "r.json").read_text())
    kept = read_manifest(tmp_path / "m").recipe["history"][-1]
    assert record["vit_val_sequential"] == kept["val_acc"] and record["reference"]["seconds"] >= 1.0
    ref = record["reference"]["val_acc"]  # a CNN of one second on 9 images may score 0: then no ratio
    assert record["ratio_val_sequential"] == (round(kept["val_acc"] / ref, 3) if ref else None)
    assert record["machine"] and record["validation_images"] == 9  # the trainer's split: 10% of 96
    with pytest.raises(SystemExit) as refused:  # not a model directory: the flag named, no traceback
        reference_main([str(tmp_path / "nothing"), "--seconds", "1"])
    assert refused.value.code == 2 and "model_dir" in capsys.readouterr().err
