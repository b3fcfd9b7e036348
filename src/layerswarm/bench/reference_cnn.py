"""The reference CNN for a run trained without one (`layerswarm train --no-reference`, as screens are):
trained on the run's own data and validation split (read from its manifest) for a given time, as `train`
would have trained it, and the run's kept epoch against it.

    python -m layerswarm.bench.reference_cnn MODEL_DIR --seconds 1026 --json out.json

`train` gives its reference the ViT's fit time (training steps plus validations), which its manifest does
not record; pass the figure a comparable run's reference got (`metrics.learned.reference.seconds`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from layerswarm.models.checkpoint import ModelDirError, read_manifest
from layerswarm.training.data.datasets import load_dataset
from layerswarm.training.data.split import validation_split
from layerswarm.training.recipe import TrainRecipe
from layerswarm.training.reference import train_reference

from . import emit_report
from .own_data import MACHINE, kept_record


def reference_for(model_dir: Path, seconds: float, workers: int = 0) -> dict[str, Any]:
    """Train the reference on `model_dir`'s split for `seconds`; the record with the ViT's kept epoch."""
    manifest = read_manifest(model_dir)
    recipe = manifest.recipe
    data = load_dataset(manifest.dataset["spec"], seed=int(manifest.dataset.get("data_seed", 0)), workers=workers)
    split_seed = recipe.get("split_seed")
    val_idx, train_idx = validation_split(
        data.train_y,
        float(recipe.get("val_fraction", TrainRecipe.val_fraction)),
        int(recipe.get("seed", TrainRecipe.seed)),
        None if split_seed is None else int(split_seed),
    )
    x = data.train_x

    def subset(idx: torch.Tensor) -> Any:
        return x[idx] if isinstance(x, torch.Tensor) else x.subset(idx)

    reference = train_reference(
        (subset(train_idx), data.train_y[train_idx]),
        (subset(val_idx), data.train_y[val_idx]),
        len(data.class_names),
        seconds,
        workers=workers,
    )
    kept = kept_record(recipe)
    if not kept:
        raise ModelDirError(f"{model_dir}: its manifest records no training history to compare with")
    return {
        "model_dir": str(model_dir),
        "reference": asdict(reference),
        "validation_images": len(val_idx),
        "vit_val_sequential": kept["val_acc"],
        "vit_val_arbitrary": kept.get("val_acc_arbitrary"),
        "ratio_val_sequential": round(kept["val_acc"] / reference.val_acc, 3) if reference.val_acc else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="a model directory trained with --no-reference")
    parser.add_argument("--seconds", type=float, required=True, help="the reference's training budget")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as the one-core runs had)")
    parser.add_argument("--json", type=Path, help="write the record here too")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error(f"--seconds must be above 0, got {args.seconds}")
    torch.set_num_threads(args.threads)
    try:
        record = reference_for(args.model_dir, args.seconds)
    except ValueError as exc:  # not a model directory, or its data is gone or unreadable: say which
        parser.error(f"model_dir: {exc}")
    record = {"written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": MACHINE, **record}
    return emit_report(record, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
