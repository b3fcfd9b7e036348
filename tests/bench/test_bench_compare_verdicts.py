"""bench/compare_verdicts.py: a compare class's three verdicts scored apart, on real predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layerswarm.bench.compare_verdicts import parse_verdicts, predictions, verdict_accuracy
from layerswarm.cli import main
from layerswarm.models.checkpoint import load_model
from layerswarm.training.data.datasets import load_dataset
from layerswarm.training.data.synthetic import COMPARE_CLASSES, write


def test_each_verdict_is_scored_on_its_own() -> None:
    names = COMPARE_CLASSES
    index = {name: i for i, name in enumerate(names)}
    truth = torch.tensor([index["shape-same_colour-same_size-same"], index["shape-diff_colour-diff_size-diff"]] * 2)
    # Every prediction right about colour and size, wrong about shape: the class is always wrong.
    wrong_shape = torch.tensor(
        [index["shape-diff_colour-same_size-same"], index["shape-same_colour-diff_size-diff"]] * 2
    )
    scores = verdict_accuracy(wrong_shape, truth, names)
    assert scores == {"shape": 0.0, "colour": 1.0, "size": 1.0, "all": 0.0}
    assert verdict_accuracy(truth, truth, names) == {"shape": 1.0, "colour": 1.0, "size": 1.0, "all": 1.0}


def test_only_compare_classes_parse() -> None:
    assert parse_verdicts("shape-same_colour-diff_size-same") == {"shape": True, "colour": False, "size": True}
    for bad in ("circle-left-larger", "shape-same_colour-diff", "shape-maybe_colour-same_size-same"):
        with pytest.raises(ValueError, match="not a compare class"):
            parse_verdicts(bad)


def test_predictions_come_from_the_model_in_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write("compare", tmp_path / "data", train=64, val=32)
    argv = ["train", "--data", f"imagefolder:{tmp_path / 'data'}", "--out", str(tmp_path / "m"), "--epochs", "1"]
    argv += ["--depth", "2", "--dim", "16", "--heads", "2", "--no-reference", "--workers", "0"]
    assert main(argv) == 0
    data = load_dataset(f"imagefolder:{tmp_path / 'data'}")
    predicted = predictions(str(tmp_path / "m"), data, batch=10)
    truth, names = data.test_y, data.class_names
    assert predicted.shape == truth.shape == (32,) and sorted(names) == sorted(COMPARE_CLASSES)
    model, _ = load_model(tmp_path / "m")
    with torch.inference_mode():
        assert torch.equal(predicted, model(data.test_x).argmax(-1))  # batching changes nothing
    scores = verdict_accuracy(predicted, truth, names)
    assert all(0 <= v <= 1 for v in scores.values()) and scores["all"] <= min(
        scores[w] for w in ("shape", "colour", "size")
    )
    # The command: the report for a compare folder; another task's folder or no folder is named, no traceback.
    from layerswarm.bench.compare_verdicts import main as verdicts

    verdicts([str(tmp_path / "data"), str(tmp_path / "m"), "--json", str(tmp_path / "v.json")])
    assert json.loads((tmp_path / "v.json").read_text())["models"][str(tmp_path / "m")]["all"] == round(
        scores["all"], 4
    )
    write("relations", tmp_path / "relations", train=8, val=8)
    for folder, reason in ((tmp_path / "relations", "not a compare class"), (tmp_path / "none", "test_folder")):
        with pytest.raises(SystemExit) as exit_:
            verdicts([str(folder), str(tmp_path / "m"), "--json", str(tmp_path / "bad.json")])
        assert exit_.value.code == 2 and reason in capsys.readouterr().err
    assert not (tmp_path / "bad.json").exists()
