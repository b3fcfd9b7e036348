"""What `layerswarm eval` measures on image models, from a typed job (cli/eval.py reads the flags; text
models: training/text/runs.py): accuracy in order and in arbitrary orders, merges, ensembles and pruning
for a family, the targets, adaptive-compute calibration, and the policies written into each model dir."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from layerswarm.models.checkpoint import Manifest, load_model, read_manifest
from layerswarm.models.policy import ACTIVATION_STATS, MIN_BLOCKS, write_entry

from ..data.datasets import Dataset, check_same_classes, iterate_batches, load_dataset, with_test_noise
from .adaptive import calibrate_model
from .calibrate import CalibrationPlan
from .evaluate import EvalPlan, activation_stats, check_targets, evaluate_models, min_useful_depth, odd_images
from .report import EvalReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalJob:
    """One `layerswarm eval`: the model directories, the data (None: the first model's), what to measure
    and what to write into the directories."""

    model_dirs: tuple[Path, ...]
    data: str | None = None
    orders: int = 10  # random orders per arbitrary-order figure
    merges: int = 20  # random merged models per family
    seed: int = 0
    workers: int = 2  # processes decoding image folders
    data_memory_mb: int = 2048  # image folders larger than this once decoded stream from disk
    experiments: bool = True  # the paper's experiments (off: calibration only)
    write_policy: bool = True  # minimum useful depth and activation statistics into each model's manifest
    min_depth_margin: float = 0.01  # fewest blocks within this accuracy of full depth
    calibrate: bool = False  # adaptive compute: exit rules, ensembles, repeated blocks
    calibration: CalibrationPlan = field(default_factory=CalibrationPlan)
    write_calibration: bool = True  # each model's adaptive policy file (never on noisy test images)
    test_noise: float = 0.0  # seeded Gaussian noise of this std on the test images (0: none)


def eval_data(job: EvalJob) -> tuple[str, Manifest]:
    """The data spec to evaluate on (the job's, else the first model's) and the first model's manifest,
    whose kind (image or text) says which evaluation runs."""
    first = read_manifest(job.model_dirs[0])  # a ModelDirError (ValueError) is the CLI's exit 2 with its message
    spec = job.data or first.dataset.get("spec")
    if not spec:
        raise ValueError("--data is needed (the manifest names no dataset)")
    return str(spec), first


def evaluate_image_models(job: EvalJob, spec: str, first: Manifest) -> EvalReport:
    data = load_dataset(
        spec,
        seed=int(first.dataset.get("data_seed", 0)),
        image_size=first.config.image_size,  # every member of a family has its base's size
        workers=job.workers,
        memory_limit_bytes=job.data_memory_mb << 20,
    )
    for model_dir in job.model_dirs:
        check_same_classes(read_manifest(model_dir).config.class_names, data.class_names, str(model_dir))
    write_calibration = job.write_calibration
    if job.test_noise:
        data = with_test_noise(data, job.test_noise)
        write_calibration = False  # a policy is calibrated on the data the model serves
    report: EvalReport = {"dataset": data.describe(), "models": {}, "groups": {}}
    if job.experiments:
        plan = EvalPlan(orders=job.orders, merges=job.merges, seed=job.seed, workers=job.workers)
        report = evaluate_models([str(d) for d in job.model_dirs], data, plan)
        report["targets"] = check_targets(report, chance=1.0 / len(data.class_names))
        if job.write_policy:
            write_policies(list(job.model_dirs), report, data, job.min_depth_margin)
    if job.calibrate:
        report["calibration"] = {
            model_name(d): calibrate_model(d, data, job.calibration, write=write_calibration) for d in job.model_dirs
        }
    return report


def model_name(model_dir: Path) -> str:
    """A model's name in reports: its directory's name."""
    return str(model_dir).rstrip("/").rsplit("/", 1)[-1]


def write_policies(model_dirs: list[Path], report: EvalReport, data: Dataset, margin: float) -> None:
    """Into each model dir: its minimum useful depth (its family's pruning curve when it has one, in
    arbitrary order for shuffle-robust variants) and per-position activation statistics."""
    test = torch.cat(list(iterate_batches(data.test_x, [torch.arange(min(len(data.test_y), 2048))])))
    images = torch.cat([test, odd_images(test)])
    for model_dir in model_dirs:
        name = model_name(model_dir)
        row = report["models"][name]
        group = report["groups"].get(f"{row['family_id']}/{row['variant']}")
        order = "arbitrary" if row["variant"].startswith("layershuffle") else "sequential"
        depth_policy = min_useful_depth((group or row)["pruned"], order, margin)
        depth_policy["measured_on"] = "family" if group else "model"
        write_entry(model_dir, MIN_BLOCKS, depth_policy)
        model, _ = load_model(model_dir)
        write_entry(model_dir, ACTIVATION_STATS, activation_stats(model, images))
        log.info("%s: min_blocks %d", name, depth_policy["value"])
