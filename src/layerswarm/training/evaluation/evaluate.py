"""The paper's experiments on any set of model directories.

Per model: sequential accuracy, arbitrary-order accuracy over random orders, pruning to k blocks (in
order and in arbitrary order). Per group of models (same family and variant, two or more members):
merged "Frankenstein" models (each block index from a randomly assigned member, blocks spread evenly
over the members, run in random order) and the ensemble of the members (mean logits), run in as many
random orders as one model is. The ensemble's margin over its best member comes with a paired bootstrap
interval over the test images: on a test set of a thousand images a margin of half a point is noise,
and the report says so rather than calling it a gain.
"""

from __future__ import annotations

import itertools
import logging
import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from tqdm import tqdm
from typing_extensions import NotRequired, TypedDict

from layerswarm.models.checkpoint import Manifest, load_model
from layerswarm.models.config import is_shuffle_robust
from layerswarm.models.paths import spread_evenly
from layerswarm.models.text.model import key_mask_of
from layerswarm.models.vit import ViT, run_blocks

from ..data.datasets import Dataset, iterate_batches
from .report import Check, EvalReport, GroupRow, ModelRow, Pruned, Summary

log = logging.getLogger(__name__)


@dataclass
class EvalPlan:
    orders: int = 10  # random orders per arbitrary-order figure
    merges: int = 20  # random merged models per group
    prune_trials: int = 5  # random subsets per pruned arbitrary-order figure
    prune_ks: Sequence[int] | None = None  # None: 1..depth
    seed: int = 0
    batch_size: int = 1000
    workers: int = 0  # processes decoding a streamed test set
    bootstrap: int = 2000  # resamples of the test images for the ensemble margin's interval


@dataclass
class Evaluated:
    name: str
    model: ViT
    manifest: Manifest
    stem_out: Tensor = field(default_factory=lambda: torch.empty(0))
    key_mask: Tensor | None = None  # text: (N, T) True for real tokens; None for images


# Activations per forward chunk: a ViT-B/16 at 224 x 224 (197 tokens) runs 166 images at a time,
# so its MLP's hidden activations stay near 400 MB however large the test set is.
TOKENS_PER_CHUNK = 1 << 15


def logit_chunks(
    head: nn.Module, x: Tensor, blocks: Sequence[nn.Module], key_mask: Tensor | None = None
) -> Iterator[Tensor]:
    """(n, classes) at a time for the stem outputs `x` (N, T, D) through `blocks` in the order given."""
    chunk = max(1, TOKENS_PER_CHUNK // x.shape[1])
    for i in range(0, len(x), chunk):
        mask = None if key_mask is None else key_mask[i : i + chunk]
        yield head(run_blocks(blocks, x[i : i + chunk], mask))


def hits(
    head: nn.Module, x: Tensor, blocks: Sequence[nn.Module], labels: Tensor, key_mask: Tensor | None = None
) -> Tensor:
    """(N,) float64 (means of a few thousand 0/1 exact to the last digit): 1 where the image is classified right."""
    predicted = torch.cat([logits.argmax(-1) for logits in logit_chunks(head, x, blocks, key_mask)])
    return (predicted == labels).double()


def accuracy(
    head: nn.Module, x: Tensor, blocks: Sequence[nn.Module], labels: Tensor, key_mask: Tensor | None = None
) -> float:
    return float(hits(head, x, blocks, labels, key_mask).mean())


def paired_interval(diff: Tensor, resamples: int, seed: int, level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval for the mean of per-image differences `diff` (N,): the images are
    resampled, the pairing kept, so what both sides get right or wrong together cancels."""
    g = torch.Generator().manual_seed(seed)
    means = torch.empty(resamples, dtype=diff.dtype)
    for i in range(0, resamples, 250):  # 250 x N indices at a time: bounded memory for large test sets
        n = min(250, resamples - i)
        means[i : i + n] = diff[torch.randint(len(diff), (n, len(diff)), generator=g)].mean(1)
    tail = (1 - level) / 2
    lo, hi = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=means.dtype)).tolist()
    return lo, hi


def summary(values: list[float]) -> Summary:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


@torch.inference_mode()
def evaluate_models(model_dirs: Sequence[str], data: Dataset, plan: EvalPlan) -> EvalReport:
    rng = random.Random(plan.seed)
    models = [_load(d, data, plan.workers) for d in model_dirs]
    report: EvalReport = {
        "dataset": data.describe(),
        "plan": {"orders": plan.orders, "merges": plan.merges, "prune_trials": plan.prune_trials, "seed": plan.seed},
        "chance": 1.0 / len(data.class_names),
        "models": {},
        "groups": {},
    }
    y = data.test_y
    arbitrary_hits: dict[str, Tensor] = {}  # per image, the fraction of random orders that got it right
    for ev in tqdm(models, desc="models", unit="model", disable=None):
        report["models"][ev.name], arbitrary_hits[ev.name] = _evaluate_one(ev, y, plan, rng)
    for key, members in _groups(models).items():
        report["groups"][key] = _evaluate_group(members, report["models"], arbitrary_hits, y, plan, rng)
    return report


def _load(model_dir: str, data: Dataset, workers: int = 0) -> Evaluated:
    model, manifest = load_model(model_dir)
    if manifest.config.num_classes != len(data.class_names):
        raise ValueError(f"{model_dir} has {manifest.config.num_classes} classes, the data has {len(data.class_names)}")
    name = str(model_dir).rstrip("/").rsplit("/", 1)[-1]
    if manifest.config.is_text:  # token ids: the stem is cheap, padding is masked in every block
        assert isinstance(data.test_x, Tensor)
        return Evaluated(name, model, manifest, model.stem(data.test_x), key_mask_of(data.test_x))
    if manifest.config.image_size != data.image_shape[1]:
        raise ValueError(
            f"{model_dir} takes {manifest.config.image_size}x{manifest.config.image_size} images, "
            f"the data is {data.image_shape[1]}x{data.image_shape[2]}"
        )
    return Evaluated(name, model, manifest, _stem_outputs(model, data, workers))


def _stem_outputs(model: ViT, data: Dataset, workers: int, batch: int = 64) -> Tensor:
    """The stem over the test set, kept for every order and merge (it is the same for all of them)."""
    n = len(data.test_y)
    chunks = [torch.arange(i, min(i + batch, n)) for i in range(0, n, batch)]
    return torch.cat([model.stem(images) for images in iterate_batches(data.test_x, chunks, workers)])


def _evaluate_one(ev: Evaluated, y: Tensor, plan: EvalPlan, rng: random.Random) -> tuple[ModelRow, Tensor]:
    """The model's row of the report, and its per-image hit rate over the random orders."""
    blocks, head, x, m = list(ev.model.blocks), ev.model.head, ev.stem_out, ev.key_mask
    depth = len(blocks)
    per_order = torch.stack([hits(head, x, _permuted(blocks, rng), y, m) for _ in range(plan.orders)])
    arbitrary = per_order.mean(1).tolist()
    pruned: dict[str, Pruned] = {}
    for k in plan.prune_ks or range(1, depth + 1):
        if not 1 <= k <= depth:
            continue
        kept = spread_evenly(range(depth), k)
        seq = accuracy(head, x, [blocks[i] for i in kept], y, m)
        arb = [accuracy(head, x, rng.sample(blocks, k), y, m) for _ in range(plan.prune_trials)]
        pruned[str(k)] = {"sequential": seq, "arbitrary": statistics.fmean(arb)}
    row: ModelRow = {
        "model_id": ev.manifest.model_id,
        "family_id": ev.manifest.family_id,
        "variant": ev.manifest.variant,
        "sequential": accuracy(head, x, blocks, y, m),
        "arbitrary": summary(arbitrary),
        "pruned": pruned,
    }
    return row, per_order.mean(0)


def _evaluate_group(
    members: list[Evaluated],
    per_model: dict[str, ModelRow],
    arbitrary_hits: dict[str, Tensor],
    y: Tensor,
    plan: EvalPlan,
    rng: random.Random,
) -> GroupRow:
    first = members[0]
    depth = len(first.model.blocks)
    head, x = first.model.head, first.stem_out  # merged models keep the first member's stem and head
    mask = first.key_mask
    merged, merged_seq = [], []
    for _ in range(plan.merges):
        blocks = _merge(members, depth, rng)
        merged_seq.append(accuracy(head, x, blocks, y, mask))
        merged.append(accuracy(head, x, _permuted(blocks, rng), y, mask))
    rows = [per_model[m.name] for m in members]
    ks = rows[0]["pruned"].keys()
    best = max(members, key=lambda m: per_model[m.name]["arbitrary"]["mean"])
    ensemble_hits = torch.stack([_ensemble_hits(members, y, rng) for _ in range(plan.orders)])
    margin = ensemble_hits.mean(0) - arbitrary_hits[best.name]
    return {
        "family_id": first.manifest.family_id,
        "variant": first.manifest.variant,
        "members": [m.name for m in members],
        "sequential": statistics.fmean(r["sequential"] for r in rows),
        "arbitrary": summary([r["arbitrary"]["mean"] for r in rows]),
        "pruned": {
            k: {
                "sequential": statistics.fmean(r["pruned"][k]["sequential"] for r in rows),
                "arbitrary": statistics.fmean(r["pruned"][k]["arbitrary"] for r in rows),
            }
            for k in ks
        },
        "merged": summary(merged),
        "merged_sequential": summary(merged_seq),
        "ensemble": float(ensemble_hits.mean()),
        "ensemble_orders": summary(ensemble_hits.mean(1).tolist()),
        "ensemble_sequential": float(_ensemble_hits(members, y, None).mean()),
        "best_member": best.name,
        "best_member_arbitrary": per_model[best.name]["arbitrary"]["mean"],
        "ensemble_minus_best_member": float(margin.mean()),
        "ensemble_minus_best_member_ci95": list(paired_interval(margin, plan.bootstrap, plan.seed)),
    }


def _ensemble_hits(members: list[Evaluated], y: Tensor, rng: random.Random | None) -> Tensor:
    """(N,) hits of the members' mean logits, each member in its own random order (in order without `rng`)."""
    total: Tensor | None = None  # the sum of the members' logits: the mean's argmax, one (N, classes) held
    for m in members:
        blocks = _permuted(list(m.model.blocks), rng) if rng else list(m.model.blocks)
        logits = torch.cat(list(logit_chunks(m.model.head, m.stem_out, blocks, m.key_mask)))
        total = logits if total is None else total + logits
    assert total is not None
    return (total.argmax(-1) == y).double()


def _merge(members: list[Evaluated], depth: int, rng: random.Random) -> list[nn.Module]:
    """nn.Module index i from member owner[i]; owners spread evenly (each member gives depth/K blocks)."""
    owners = [i % len(members) for i in range(depth)]
    rng.shuffle(owners)
    return [members[o].model.blocks[i] for i, o in enumerate(owners)]


def _permuted(blocks: list[nn.Module], rng: random.Random) -> list[nn.Module]:
    return rng.sample(blocks, len(blocks))


def _groups(models: list[Evaluated]) -> dict[str, list[Evaluated]]:
    groups: dict[str, list[Evaluated]] = {}
    for ev in models:
        groups.setdefault(f"{ev.manifest.family_id}/{ev.manifest.variant}", []).append(ev)
    return {k: v for k, v in groups.items() if len(v) >= 2}


def check_targets(report: EvalReport, chance: float) -> dict[str, dict[str, Check]]:
    """The issue's targets, evaluated on a report (for the README and the CLI summary)."""
    out: dict[str, dict[str, Check]] = {}
    for key, g in report["groups"].items():
        if is_shuffle_robust(g["variant"]):
            arb = g["arbitrary"]["mean"]
            out[key] = {
                "arbitrary_over_sequential": arb / g["sequential"],
                "merged_over_arbitrary": g["merged"]["mean"] / arb,
                "ensemble_minus_best_member": g["ensemble"] - g["best_member_arbitrary"],
                **_ensemble_verdict(g),
                "pruning_monotone_arbitrary": _monotone([v["arbitrary"] for v in g["pruned"].values()]),
            }
    for name, m in report["models"].items():
        if m["variant"] == "baseline":
            kept = kept_above_chance(m["sequential"], m["arbitrary"]["mean"], chance)
            out[name] = {
                "baseline_arbitrary_minus_chance": m["arbitrary"]["mean"] - chance,
                "baseline_kept_above_chance": kept,
                "baseline_collapsed": kept <= COLLAPSED_AT,
                "pruning_monotone_arbitrary": _monotone([v["arbitrary"] for v in m["pruned"].values()]),
            }
    return out


# A model "collapses" in arbitrary order when it keeps at most a tenth of what it learnt above chance
# (the paper's ViT-B/16 kept 0.0004: 82.61% -> 0.13%, chance 0.1%). Small pre-norm models are partly
# order-robust by nature (shared/notes: the baseline loses about half), so the share is reported, not
# only the verdict.
COLLAPSED_AT = 0.1


def kept_above_chance(sequential: float, arbitrary: float, chance: float) -> float:
    """The share of its in-order accuracy above chance that a model keeps in arbitrary order (0: none,
    1: all; negative below chance). A model at chance in order learnt nothing to keep: 1.0."""
    learnt = sequential - chance
    return (arbitrary - chance) / learnt if learnt > 0 else 1.0


def _ensemble_verdict(group: GroupRow) -> dict[str, Check]:
    """Whether the ensemble beats its best member beyond the test set's noise: "above" when the whole
    95% interval is above zero, "below" when it is below, else "within noise" (reports before the
    interval existed have none, and get no verdict)."""
    interval = group.get("ensemble_minus_best_member_ci95")
    if interval is None:
        return {}
    lo, hi = interval
    verdict = "above" if lo > 0 else "below" if hi < 0 else "within noise"
    return {"ensemble_minus_best_member_ci95": interval, "ensemble_vs_best_member": verdict}


def _monotone(values: list[float], slack: float = 0.01) -> bool:
    return all(b >= a - slack for a, b in itertools.pairwise(values))


class MinDepth(TypedDict):
    """A model's `min_blocks` policy entry (models/policy.py), which the coordinator reads as its default."""

    value: int
    margin: float
    order: str  # the pruned curve it was read from: arbitrary or sequential
    accuracy_full: float
    accuracy_at_min: float
    curve: dict[str, float]
    measured_on: NotRequired[str]  # "family" (the group's mean curve) or "model"


def min_useful_depth(pruned: dict[str, Pruned], order: str, margin: float = 0.01) -> MinDepth:
    """The fewest blocks whose accuracy (pruned curve, `order`: arbitrary or sequential) stays within
    `margin` of the full-depth accuracy on the same curve: the coordinator's honest default min_blocks."""
    curve = {int(k): v["arbitrary"] if order == "arbitrary" else v["sequential"] for k, v in pruned.items()}
    depth = max(curve)
    full = curve[depth]
    value = min(k for k, acc in curve.items() if acc >= full - margin)
    return {
        "value": value,
        "margin": margin,
        "order": order,
        "accuracy_full": round(full, 4),
        "accuracy_at_min": round(curve[value], 4),
        "curve": {str(k): round(curve[k], 4) for k in sorted(curve)},
    }


class PositionRange(TypedDict):
    max_abs: float
    rms_min: float
    rms_max: float


class ActivationStats(TypedDict):
    """A model's `activation_stats` policy entry: the range of activations after each position, which
    the coordinator's range check (coordinator/ranges.py) reads."""

    order: str
    samples: int
    orders: int
    positions: list[PositionRange]


@torch.inference_mode()
def activation_stats(model: ViT, images: Tensor, orders: int = 5, seed: int = 0) -> ActivationStats:
    """Per position p, the range of activations after p+1 blocks (arbitrary orders for shuffle-robust
    models, else in order): the largest |x| and the range of per-image RMS. A coordinator's cheap first
    filter for lying nodes. `images` should include odd inputs (noise, flat images) so that a strange
    upload does not look like a lie."""
    rng = random.Random(seed)
    depth = len(model.blocks)
    robust = model.cfg.shuffle_robust
    peaks = [0.0] * depth
    rms_lo, rms_hi = [float("inf")] * depth, [0.0] * depth
    for _ in range(orders if robust else 1):
        order = rng.sample(range(depth), depth) if robust else list(range(depth))
        x = model.stem(images)
        for position, index in enumerate(order):
            x = model.blocks[index](x, position)
            rms = x.pow(2).mean(dim=(1, 2)).sqrt()
            peaks[position] = max(peaks[position], float(x.abs().max()))
            rms_lo[position] = min(rms_lo[position], float(rms.min()))
            rms_hi[position] = max(rms_hi[position], float(rms.max()))
    return {
        "order": "arbitrary" if robust else "sequential",
        "samples": int(images.shape[0]),
        "orders": orders if robust else 1,
        "positions": [
            {"max_abs": round(p, 4), "rms_min": round(lo, 4), "rms_max": round(hi, 4)}
            for p, lo, hi in zip(peaks, rms_lo, rms_hi, strict=True)
        ],
    }


def odd_images(like: Tensor, count: int = 64, seed: int = 0) -> Tensor:
    """Uniform noise and flat images in the data's value range: what a careless or hostile client uploads."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = float(like.min()), float(like.max())
    noise = lo + (hi - lo) * torch.rand((count, *like.shape[1:]), generator=g)
    flat = torch.linspace(lo, hi, 8).view(8, 1, 1, 1).expand(8, *like.shape[1:])
    return torch.cat([noise, flat])
