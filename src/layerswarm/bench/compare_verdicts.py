"""Which of its three verdicts a model gets right on the generated `compare` task.

A `compare` class is three verdicts at once (same shape? same colour? same size?), so an accuracy of
0.5 may be two verdicts solved and one at chance. This splits a model's predictions (in order, on a
test folder) into the three, to show which one a family of models shares as a blind spot: where every
member fails the same verdict, their ensemble has nothing to add.

    python -m layerswarm.bench.compare_verdicts TEST_FOLDER MODEL_DIR... --json OUT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from layerswarm.models.checkpoint import load_model, read_manifest
from layerswarm.training.data.datasets import Dataset, iterate_batches, load_dataset

VERDICTS = ("shape", "colour", "size")


def parse_verdicts(class_name: str) -> dict[str, bool]:
    """'shape-same_colour-diff_size-same' -> {'shape': True, 'colour': False, 'size': True}."""
    parts = dict(part.split("-", 1) for part in class_name.split("_"))
    if set(parts) != set(VERDICTS) or not set(parts.values()) <= {"same", "diff"}:
        raise ValueError(f"{class_name!r} is not a compare class (shape-*_colour-*_size-*)")
    return {what: parts[what] == "same" for what in VERDICTS}


def verdict_accuracy(predicted: torch.Tensor, truth: torch.Tensor, class_names: tuple[str, ...]) -> dict[str, float]:
    """Accuracy of each verdict and of the whole class, from (N,) class indices."""
    table = torch.tensor([[parse_verdicts(name)[what] for what in VERDICTS] for name in class_names])  # (C, 3)
    hits = table[predicted] == table[truth]  # (N, 3)
    out = {what: float(hits[:, i].float().mean()) for i, what in enumerate(VERDICTS)}
    out["all"] = float((predicted == truth).float().mean())
    return out


@torch.inference_mode()
def predictions(model_dir: str, data: Dataset, batch: int = 250) -> torch.Tensor:
    """(N,) class indices of `model_dir` on `data`'s test split, blocks in order."""
    model, _ = load_model(model_dir)
    n = len(data.test_y)
    chunks = [torch.arange(i, min(i + batch, n)) for i in range(0, n, batch)]
    return torch.cat([model(images).argmax(-1) for images in iterate_batches(data.test_x, chunks)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_folder", type=Path, help="a `layerswarm datasets compare` folder (its val/ split)")
    parser.add_argument("models", nargs="+", help="model directories")
    parser.add_argument("--json", type=Path, required=True, help="where to write the per-model verdicts")
    args = parser.parse_args(argv)
    for model_dir in args.models:  # every directory checked before minutes of work, named if not a model
        try:
            read_manifest(model_dir)
        except ValueError as err:
            parser.error(str(err))
    torch.set_num_threads(1)
    try:
        data = load_dataset(f"imagefolder:{args.test_folder}")  # decoded once for every model
        for name in data.class_names:
            parse_verdicts(name)
    except ValueError as err:
        parser.error(f"test_folder {args.test_folder}: {err}")
    report = {}
    for model_dir in args.models:
        scores = verdict_accuracy(predictions(model_dir, data), data.test_y, data.class_names)
        report[model_dir] = {k: round(v, 4) for k, v in scores.items()}
        print(model_dir, report[model_dir], flush=True)
    args.json.write_text(json.dumps({"test_folder": str(args.test_folder), "models": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
