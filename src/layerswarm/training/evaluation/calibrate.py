"""Calibration of adaptive compute on one model: exit rules, path ensembles and repeated blocks.

Everything runs in arbitrary order, as a LayerShuffle swarm does (sequential for a model that is not
shuffle-robust): by default every image takes an order of its own, as every request through the swarm
does, so that eval's figures and the swarm's agree on the same images. The test split is cut in two:
thresholds are chosen on the first half ("calibration") and every reported figure comes from the second
half ("held out"), so a chosen threshold is never judged on the images that chose it.

- exits: per rule, accuracy against mean blocks run over a sweep of thresholds; the chosen threshold
  is the cheapest whose accuracy stays within `margin` of the full path with `spare_se` standard errors
  of the loss to spare (the loss paired over the images: the cheapest of some 40 candidates, chosen on
  1,000 images, otherwise loses more on others than it did on those); the default rule is the cheapest
  of the chosen ones.
- ensemble: a second route (another random order) started only when the first answer is unsure
  (its confidence below a threshold), logits averaged; the threshold is the most accurate one under
  `max_hops_ratio` times the single path's mean hops.
- repeats: accuracy with k block indices missing, the path shorter (skipped) or filled back to full
  length by running present indices again (repeated).
- anytime: accuracy answering after exactly k blocks (what a deadline that cuts the path leaves); the
  anytime floor is the fewest blocks within `anytime_margin` of the full path, the fewest an answer cut
  by a request's deadline may have.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from typing_extensions import NotRequired, TypedDict

from layerswarm.models.exits import RULES, ExitPolicy, ExitRule, simulate
from layerswarm.models.vit import run_blocks

CONFIDENCE_SWEEP = (0.3, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 0.9999, 1.0)
ENTROPY_SWEEP = (0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.07, 0.05, 0.03, 0.02, 0.01, 0.005, 0.001, 0.0)
ENSEMBLE_SWEEP = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999)


class SweepPoint(TypedDict):
    threshold: float
    accuracy: float
    mean_blocks: float
    exited: float  # the share of images that exited before the last block


class Halves(TypedDict):
    calibration: float
    held_out: float


class HeldOut(TypedDict):
    held_out: float


class ChosenExit(TypedDict):
    threshold: float
    calibration: SweepPoint  # where it was chosen
    held_out: dict[str, float]  # accuracy and mean_blocks on the other half


class RuleCalibration(TypedDict):
    curve: list[SweepPoint]  # held out
    chosen: ChosenExit | None  # None: no threshold within the margin


class ExitChoice(TypedDict):
    rule: str
    threshold: float


class ExitCalibration(TypedDict):
    margin: float
    spare_se: float  # standard errors of the paired loss the chosen threshold keeps inside the margin
    min_blocks: int  # the exit floor: no exit before this depth
    depth: int
    images: dict[str, int]  # calibration, held_out
    full_accuracy: Halves
    rules: dict[str, RuleCalibration]
    default: ExitChoice | None  # the cheapest chosen rule


class EnsemblePoint(TypedDict):
    threshold: float
    accuracy: float
    hops_ratio: float  # hops against a single path
    second_route: float  # the share of images that took a second route


class ChosenEnsemble(TypedDict):
    threshold: float
    held_out: EnsemblePoint | None


class EnsembleCalibration(TypedDict):
    depth: int
    single_accuracy: HeldOut
    parallel_2_accuracy: HeldOut
    curve: list[EnsemblePoint]
    max_hops_ratio: float
    chosen: ChosenEnsemble | None


class AnytimeCalibration(TypedDict):
    margin: float
    min_blocks: int  # the anytime floor, chosen on the calibration half
    curve: dict[str, Halves]  # blocks run -> accuracy answering after exactly that many, both halves


class RepeatReport(TypedDict):
    order: str
    by_missing: dict[str, dict[str, float]]  # k missing -> skipped, repeated
    mean_gain: float
    helps: bool


class AdaptivePolicy(TypedDict):
    """DIR/adaptive.json (models/adaptive_policy.py): what the coordinator reads."""

    exit: ExitChoice | None
    exit_thresholds: dict[str, float]
    margin: float
    exit_min_blocks: int  # the exit floor the thresholds were calibrated with
    anytime_min_blocks: int  # the fewest blocks an answer cut by a deadline may have
    anytime_margin: float  # within this accuracy of the full path (calibration half)
    ensemble_confidence: float | None
    repeats: bool
    model_id: NotRequired[str]  # written with the file: the model and data it was calibrated on
    dataset: NotRequired[str]


@dataclass
class CalibrationPlan:
    margin: float = 0.01  # accuracy the chosen exit threshold may lose against the full path
    spare_se: float = 1.0  # ... with this many standard errors of that loss to spare (calibration half)
    min_blocks: int = 1  # exits are allowed from this depth on
    # Images that share one random order. 1: an order per image, as the swarm draws one per request; with
    # 50 a test split of 2,000 saw 40 orders, and eval's figures differed from the swarm's by 2-4 points.
    chunk: int = 1
    anytime_margin: float = 0.10  # accuracy an answer cut by a deadline may lose against the full path
    max_hops_ratio: float = 1.3  # adaptive ensemble: the most it may cost against a single path
    repeat_trials: int = 4
    seed: int = 0


def thresholds(rule: ExitRule, depth: int) -> tuple[float, ...]:
    if rule is ExitRule.CONFIDENCE:
        return CONFIDENCE_SWEEP
    if rule is ExitRule.ENTROPY:
        return ENTROPY_SWEEP
    return tuple(float(k) for k in range(1, depth))


@torch.inference_mode()
def prefix_logits(
    blocks: Sequence[nn.Module],
    head: nn.Module,
    x: Tensor,
    robust: bool,
    rng: random.Random,
    chunk: int,
    key_mask: Tensor | None = None,
) -> Tensor:
    """(N, L, classes): the head's logits after every hop; each chunk of images takes a fresh order.
    key_mask: text, (N, T) True for real tokens."""
    out = []
    for i in range(0, x.shape[0], chunk):
        order = rng.sample(range(len(blocks)), len(blocks)) if robust else list(range(len(blocks)))
        h, steps = x[i : i + chunk], []
        mask = None if key_mask is None else key_mask[i : i + chunk]
        for position, index in enumerate(order):
            h = blocks[index](h, position) if mask is None else blocks[index](h, position, mask)
            steps.append(head(h))
        out.append(torch.stack(steps, 1))
    return torch.cat(out)


def sweep(prefix: Tensor, y: Tensor, rule: ExitRule, min_blocks: int) -> list[SweepPoint]:
    points: list[SweepPoint] = []
    for t in thresholds(rule, prefix.shape[1]):
        depth, answer = simulate(prefix, ExitPolicy(rule, t), min_blocks)
        points.append(
            {
                "threshold": t,
                "accuracy": _acc(answer, y),
                "mean_blocks": float(depth.float().mean()),
                "exited": float((depth < prefix.shape[1]).float().mean()),
            }
        )
    return points


def choose(
    points: list[SweepPoint], full_accuracy: float, margin: float, spare: dict[float, float] | None = None
) -> SweepPoint | None:
    """The cheapest point within `margin` of the full path, with `spare[threshold]` more accuracy to spare."""
    ok = [p for p in points if p["accuracy"] >= full_accuracy - margin + (spare or {}).get(p["threshold"], 0.0)]
    return min(ok, key=lambda p: (p["mean_blocks"], -p["accuracy"])) if ok else None


def loss_standard_errors(prefix: Tensor, y: Tensor, rule: ExitRule, min_blocks: int) -> dict[float, float]:
    """Per threshold: the standard error of the accuracy the exit loses against the full path, paired over
    the images (each image's correct at full depth minus correct where it exited)."""
    full = (prefix[:, -1].argmax(-1) == y).float()
    out: dict[float, float] = {}
    for t in thresholds(rule, prefix.shape[1]):
        _, answer = simulate(prefix, ExitPolicy(rule, t), min_blocks)
        lost = full - (answer.argmax(-1) == y).float()
        out[t] = float(lost.std()) / math.sqrt(len(y)) if len(y) > 1 else 0.0
    return out


def calibrate_exits(prefix: Tensor, y: Tensor, plan: CalibrationPlan) -> ExitCalibration:
    """Choose on the first half, report on the second half."""
    half = prefix.shape[0] // 2
    cal, held, y_cal, y_held = prefix[:half], prefix[half:], y[:half], y[half:]
    full_cal, full_held = _acc(cal[:, -1], y_cal), _acc(held[:, -1], y_held)
    rules: dict[str, RuleCalibration] = {}
    for name in RULES:
        rule = ExitRule(name)
        spare = {t: plan.spare_se * se for t, se in loss_standard_errors(cal, y_cal, rule, plan.min_blocks).items()}
        chosen = choose(sweep(cal, y_cal, rule, plan.min_blocks), full_cal, plan.margin, spare)
        entry: RuleCalibration = {"curve": sweep(held, y_held, rule, plan.min_blocks), "chosen": None}
        if chosen is not None:
            depth, answer = simulate(held, ExitPolicy(rule, chosen["threshold"]), plan.min_blocks)
            entry["chosen"] = {
                "threshold": chosen["threshold"],
                "calibration": chosen,
                "held_out": {"accuracy": _acc(answer, y_held), "mean_blocks": float(depth.float().mean())},
            }
        rules[name] = entry
    picked = [(n, rule_choice) for n, r in rules.items() if (rule_choice := r["chosen"]) is not None]
    best = min(picked, key=lambda p: p[1]["calibration"]["mean_blocks"]) if picked else None
    return {
        "margin": plan.margin,
        "spare_se": plan.spare_se,
        "min_blocks": plan.min_blocks,
        "depth": prefix.shape[1],
        "images": {"calibration": half, "held_out": prefix.shape[0] - half},
        "full_accuracy": {"calibration": full_cal, "held_out": full_held},
        "rules": rules,
        "default": None if best is None else {"rule": best[0], "threshold": best[1]["threshold"]},
    }


def calibrate_ensemble(first: Tensor, second: Tensor, y: Tensor, plan: CalibrationPlan) -> EnsembleCalibration:
    """first, second: (N, L, classes) prefix logits of two routes in different orders (full paths)."""
    half = first.shape[0] // 2
    depth = first.shape[1]

    def curve(a: Tensor, b: Tensor, labels: Tensor) -> list[EnsemblePoint]:
        single = a[:, -1]
        both = (a[:, -1] + b[:, -1]) / 2
        points: list[EnsemblePoint] = []
        for t in ENSEMBLE_SWEEP:
            unsure = single.softmax(-1).max(-1).values < t
            answer = torch.where(unsure[:, None], both, single)
            points.append(
                {
                    "threshold": t,
                    "accuracy": _acc(answer, labels),
                    "hops_ratio": 1.0 + float(unsure.float().mean()),
                    "second_route": float(unsure.float().mean()),
                }
            )
        return points

    cal = curve(first[:half], second[:half], y[:half])
    held = curve(first[half:], second[half:], y[half:])
    ok = [p for p in cal if p["hops_ratio"] < plan.max_hops_ratio]
    chosen = max(ok, key=lambda p: (p["accuracy"], -p["hops_ratio"])) if ok else None
    held_chosen = next((p for p in held if chosen and p["threshold"] == chosen["threshold"]), None)
    return {
        "depth": depth,
        "single_accuracy": {"held_out": _acc(first[half:, -1], y[half:])},
        "parallel_2_accuracy": {"held_out": _acc((first[half:, -1] + second[half:, -1]) / 2, y[half:])},
        "curve": held,
        "max_hops_ratio": plan.max_hops_ratio,
        "chosen": None if chosen is None else {"threshold": chosen["threshold"], "held_out": held_chosen},
    }


def calibrate_anytime(prefix: Tensor, y: Tensor, plan: CalibrationPlan) -> AnytimeCalibration:
    """Accuracy answering after exactly k blocks, k = 1..L; the floor is chosen on the first half: the
    fewest blocks within `anytime_margin` of that half's full-path accuracy."""
    half = prefix.shape[0] // 2
    depth = prefix.shape[1]
    curve: dict[str, Halves] = {
        str(k): {"calibration": _acc(prefix[:half, k - 1], y[:half]), "held_out": _acc(prefix[half:, k - 1], y[half:])}
        for k in range(1, depth + 1)
    }
    full = curve[str(depth)]["calibration"]
    floor = min(k for k in range(1, depth + 1) if curve[str(k)]["calibration"] >= full - plan.anytime_margin)
    return {"margin": plan.anytime_margin, "min_blocks": floor, "curve": curve}


@torch.inference_mode()
def repeats(
    blocks: Sequence[nn.Module],
    head: nn.Module,
    x: Tensor,
    y: Tensor,
    robust: bool,
    plan: CalibrationPlan,
    key_mask: Tensor | None = None,
) -> RepeatReport:
    """Accuracy with k of L block indices missing: the path skips them, or repeats present ones."""
    rng = random.Random(plan.seed + 1)
    depth = len(blocks)
    by_missing: dict[str, dict[str, float]] = {}
    for k in range(1, max(1, depth // 2) + 1):
        skipped, repeated = [], []
        for _ in range(plan.repeat_trials):
            present = sorted(rng.sample(range(depth), depth - k))
            fill = present + [rng.choice(present) for _ in range(k)]
            short = rng.sample(present, len(present)) if robust else present
            full = rng.sample(fill, len(fill)) if robust else sorted(fill)
            skipped.append(_acc(head(run_blocks([blocks[i] for i in short], x, key_mask)), y))
            repeated.append(_acc(head(run_blocks([blocks[i] for i in full], x, key_mask)), y))
        by_missing[str(k)] = {"skipped": sum(skipped) / len(skipped), "repeated": sum(repeated) / len(repeated)}
    gains = [v["repeated"] - v["skipped"] for v in by_missing.values()]
    # "helps": on average over k, a path filled with repeats beats the shorter one (the alternative the
    # coordinator has when too few indices are reachable is a shorter path, or none at all)
    mean_gain = sum(gains) / len(gains)
    return {
        "order": "arbitrary" if robust else "sequential",
        "by_missing": by_missing,
        "mean_gain": mean_gain,
        "helps": mean_gain > 0.0,
    }


def policy_record(
    exits: ExitCalibration, ensemble: EnsembleCalibration, repeat: RepeatReport, anytime: AnytimeCalibration
) -> AdaptivePolicy:
    """What the coordinator reads from DIR/adaptive.json (the full curves stay in the eval report)."""
    chosen = ensemble.get("chosen")
    return {
        "exit": exits["default"],
        "exit_thresholds": {n: c["threshold"] for n, r in exits["rules"].items() if (c := r["chosen"])},
        "margin": exits["margin"],
        "exit_min_blocks": exits["min_blocks"],
        "anytime_min_blocks": anytime["min_blocks"],
        "anytime_margin": anytime["margin"],
        "ensemble_confidence": None if chosen is None else chosen["threshold"],
        "repeats": repeat["helps"],
    }


def accuracy_at_blocks(curve: list[SweepPoint], blocks: float) -> float | None:
    """A sweep's accuracy at a given mean depth, linearly interpolated (None outside the curve):
    how two models compare at equal mean compute."""
    points = sorted((p["mean_blocks"], p["accuracy"]) for p in curve)
    for (b0, a0), (b1, a1) in itertools.pairwise(points):
        if b0 <= blocks <= b1:
            return a0 if b1 == b0 else a0 + (a1 - a0) * (blocks - b0) / (b1 - b0)
    return None


def _acc(logits: Tensor, y: Tensor) -> float:
    return float((logits.argmax(-1) == y).float().mean())
