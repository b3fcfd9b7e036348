"""Sample inputs of a model's task: the test split of the data it was trained on, as PNG bytes.

One loader for `up`, `samples`, the benchmarks, the chaos load and the tests (the swarm classifies PNGs
over HTTP, so samples travel as the bytes an operator would send).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.images import png_bytes
from layerswarm.training.data.datasets import Dataset, load_dataset
from layerswarm.training.text.data import load_text_data

__all__ = ["Sample", "labelled_samples", "png_bytes", "task_data", "write_samples"]


class Sample(NamedTuple):
    png: bytes
    label: str  # the class name the image shows


def task_data(model_dir: Path) -> Dataset:
    """The data a model directory was trained on (its manifest names the spec and the seed)."""
    manifest = read_manifest(model_dir)
    spec, seed = manifest.dataset["spec"], int(manifest.dataset.get("data_seed", 0))
    if manifest.config.is_text:
        return load_text_data(spec, model_dir)
    return load_dataset(spec, seed=seed, image_size=manifest.config.image_size)


def labelled_samples(data: Dataset, indices: list[int] | range) -> list[Sample]:
    return [Sample(png_bytes(data.test_x[i].numpy()), data.class_names[int(data.test_y[i])]) for i in indices]


def write_samples(data: Dataset, out: Path, count: int) -> list[Path]:
    """Write `count` test images as OUT/<index>-<label>.png (the label in the name, for eyes and scripts)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, sample in enumerate(labelled_samples(data, range(min(count, len(data.test_y))))):
        path = out / f"{i:03d}-{sample.label.replace('/', '_')}.png"
        path.write_bytes(sample.png)
        written.append(path)
    return written
