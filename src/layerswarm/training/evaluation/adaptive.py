"""`layerswarm eval --calibrate`: adaptive-compute calibration per model directory, and its policy file."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Protocol

import torch
from typing_extensions import NotRequired, TypedDict

from layerswarm.models.adaptive_policy import write_policy
from layerswarm.models.checkpoint import load_model
from layerswarm.models.text.specials import PAD_ID

from .calibrate import (
    AdaptivePolicy,
    AnytimeCalibration,
    CalibrationPlan,
    EnsembleCalibration,
    ExitCalibration,
    RepeatReport,
    accuracy_at_blocks,
    calibrate_anytime,
    calibrate_ensemble,
    calibrate_exits,
    policy_record,
    prefix_logits,
    repeats,
)

log = logging.getLogger(__name__)


class TestSplit(Protocol):
    """What calibration reads of a data set (image Dataset and TextDataset alike)."""

    spec: str
    test_x: Any  # a Tensor when in memory: images (N, C, H, W), or token ids (N, T)
    test_y: torch.Tensor


class CalibrationRecord(TypedDict):
    """One model's calibration in the eval report (`calibration`), and the policy written from it."""

    model_id: str
    variant: str
    order: str
    exits: ExitCalibration
    ensemble: EnsembleCalibration
    repeats: RepeatReport
    anytime: AnytimeCalibration
    policy: AdaptivePolicy
    policy_sha256: NotRequired[str]  # when written: DIR/adaptive.json's hash, as the manifest lists it


@torch.inference_mode()
def calibrate_model(model_dir: Path, data: TestSplit, plan: CalibrationPlan, write: bool) -> CalibrationRecord:
    """Images or text: a text model's blocks are given its token mask (padding is never attended to)."""
    model, manifest = load_model(model_dir)
    robust = manifest.config.shuffle_robust
    blocks, head = list(model.blocks), model.head
    if not isinstance(data.test_x, torch.Tensor):
        raise ValueError("calibration needs the test images in memory (this image folder streams from disk)")
    x = model.stem(data.test_x)
    mask = data.test_x != PAD_ID if manifest.config.is_text else None
    y = data.test_y
    rng = random.Random(plan.seed)
    first = prefix_logits(blocks, head, x, robust, rng, plan.chunk, mask)
    second = prefix_logits(blocks, head, x, robust, rng, plan.chunk, mask)  # the same images, other orders
    exits = calibrate_exits(first, y, plan)
    ensemble = calibrate_ensemble(first, second, y, plan)
    anytime = calibrate_anytime(first, y, plan)
    half = len(y) // 2  # repeats: on the held-out half only (the costliest part: many full passes)
    held_mask = None if mask is None else mask[half:]
    repeat = repeats(blocks, head, x[half:], y[half:], robust, plan, held_mask)
    policy = policy_record(exits, ensemble, repeat, anytime)
    result: CalibrationRecord = {
        "model_id": manifest.model_id,
        "variant": manifest.variant,
        "order": "arbitrary" if robust else "sequential",
        "exits": exits,
        "ensemble": ensemble,
        "repeats": repeat,
        "anytime": anytime,
        "policy": policy,
    }
    if write:
        policy["model_id"] = manifest.model_id
        policy["dataset"] = data.spec
        result["policy_sha256"] = write_policy(model_dir, policy)
        log.info("wrote the adaptive policy of %s: %s", model_dir, policy)
    return result


def render_calibration(calibration: dict[str, CalibrationRecord]) -> str:
    lines = [
        "| model | rule | threshold | accuracy (held out) | mean blocks | reduction | full-path accuracy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in calibration.items():
        exits = c["exits"]
        full = exits["full_accuracy"]["held_out"]
        for rule, r in exits["rules"].items():
            chosen = r["chosen"]
            if chosen is None:
                lines.append(f"| {name} | {rule} | none within the margin | | | | {full:.4f} |")
                continue
            held = chosen["held_out"]
            lines.append(
                f"| {name} | {rule} | {chosen['threshold']:g} | {held['accuracy']:.4f} | "
                f"{held['mean_blocks']:.2f} | {exits['depth'] / held['mean_blocks']:.2f}x | {full:.4f} |"
            )
    depths = (3.0, 4.0, 5.0, 6.0)
    lines += [
        "",
        "| model: accuracy at equal mean blocks (confidence rule) | " + " | ".join(f"{d:g}" for d in depths) + " |",
    ]
    lines.append("| --- |" + " --- |" * len(depths))
    for name, c in calibration.items():
        curve = c["exits"]["rules"]["confidence"]["curve"]
        at = [accuracy_at_blocks(curve, d) for d in depths]
        lines.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in at) + " |")
    lines += ["", "| model | single path | adaptive ensemble (threshold, hops ratio) | two routes always |"]
    lines.append("| --- | --- | --- | --- |")
    for name, c in calibration.items():
        ens = c["ensemble"]
        second = ens["chosen"]
        held_out = second["held_out"] if second else None
        adaptive = (
            f"{held_out['accuracy']:.4f} ({second['threshold']:g}, {held_out['hops_ratio']:.2f}x)"
            if second and held_out
            else "-"
        )
        lines.append(
            f"| {name} | {ens['single_accuracy']['held_out']:.4f} | {adaptive} | "
            f"{ens['parallel_2_accuracy']['held_out']:.4f} |"
        )
    lines += ["", "| model | order | k missing: skipped / repeated | repeats help |", "| --- | --- | --- | --- |"]
    for name, c in calibration.items():
        rep = c["repeats"]
        cells = ", ".join(f"{k}: {v['skipped']:.3f} / {v['repeated']:.3f}" for k, v in rep["by_missing"].items())
        lines.append(f"| {name} | {rep['order']} | {cells} | {rep['helps']} |")
    lines += ["", "| model | anytime floor (margin) | accuracy after k blocks, held out |", "| --- | --- | --- |"]
    for name, c in calibration.items():
        any_ = c["anytime"]
        cells = ", ".join(f"{k}: {v['held_out']:.3f}" for k, v in any_["curve"].items())
        lines.append(f"| {name} | {any_['min_blocks']} ({100 * any_['margin']:g} points) | {cells} |")
    return "\n".join(lines)
