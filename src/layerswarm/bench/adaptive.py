"""Adaptive compute through a live swarm (one node per block, gRPC on loopback, fp16 on the wire):

- exit curves: the head's logits after every hop of real paths, swept like `layerswarm eval` does, so
  the live curves can be compared with eval's;
- calibrated defaults against the full path, batch 1, interleaved: accuracy, blocks per request, latency;
- adaptive path ensembles against single paths on a harder held-back split (noisy test images), with
  the second route over another order of the same model or over another family member (its stem,
  nodes and head), in eval (offline) and through a swarm of both members' nodes;
- anytime answers under a deadline that allows about half the path.

Every figure is on the held-out half of the test split (the half calibration did not choose on).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, DepthError, Policy
from layerswarm.models.checkpoint import load_model, read_manifest
from layerswarm.models.exits import RULES, ExitRule
from layerswarm.training.data.datasets import Dataset, load_dataset, with_test_noise
from layerswarm.training.evaluation.calibrate import (
    CalibrationPlan,
    SweepPoint,
    calibrate_ensemble,
    prefix_logits,
    sweep,
)

from .fixtures import addresses, median_ms, nodes
from .shipped import layout
from .vitb import coordinator

NOISE = 0.25  # std of the noise of the harder split: layershuffle-0 drops from ~99% to 80-87% (400 images)
CHUNK = 50  # images per recorded batch: one random order each, as eval's calibration uses


async def run(members: list[tuple[Path, Path | None]], images: int) -> dict[str, Any]:
    """members: (model dir, the partner member its ensembles route over, if any)."""
    out: dict[str, Any] = {"images": images, "noise": NOISE, "members": {}}
    for member, partner in members:
        out["members"][member.name] = await _member(member, partner, images)
    return out


async def _member(member: Path, partner: Path | None, images: int) -> dict[str, Any]:
    manifest = read_manifest(member)
    data = load_dataset(manifest.dataset["spec"], seed=int(manifest.dataset.get("data_seed", 0)))
    half = len(data.test_y) // 2
    x, y = data.test_x[half : half + images], data.test_y[half : half + images]
    noisy = with_test_noise(data, NOISE)
    with nodes(layout([member])) as procs:
        coord = coordinator(member, addresses(procs), "fp16", "stream")
        await coord.start()
        try:
            result: dict[str, Any] = {"policy": coord.router.adaptive.to_json()}
            result["live_curves"] = await _live_curves(coord, x, y)
            result["live_vs_eval"] = _agreement(member, x, y, result["live_curves"])
            result["calibrated_vs_full"] = await _calibrated_vs_full(coord, x, y)
            full_ms = result["calibrated_vs_full"]["full"]["latency_p50_ms"]
            result["anytime"] = await _anytime(coord, x, y, full_ms / 2)
        finally:
            await coord.stop()
    result["eval_noisy"] = _noisy_ensembles(member, partner, noisy)
    threshold = result["eval_noisy"]["threshold"]
    nx, ny = noisy.test_x[half : half + images], noisy.test_y[half : half + images]
    with nodes(layout([member, *([partner] if partner else [])])) as procs:
        settings = coordinator(member, addresses(procs), "fp16", "stream").settings
        family = (partner,) if partner else ()
        coord = Coordinator(settings.model_copy(update={"family_dirs": family}))
        await coord.start()
        try:
            result["ensemble_noisy"] = await _ensemble(coord, nx, ny, threshold, with_members=partner is not None)
        finally:
            await coord.stop()
    return result


async def _live_curves(coord: Coordinator, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Record the head's logits after every hop of full paths (a rule that never fires asks the head
    after each hop), then sweep every rule over them as eval does."""
    recorded: list[torch.Tensor] = []
    head = coord.router.head_logits

    async def recording(activations: torch.Tensor) -> torch.Tensor:
        logits = await head(activations)
        if len(activations) == batch:  # the exit check's; the decisive-hop check stacks every stage
            recorded.append(logits)
        return logits

    coord.router.head_logits = recording  # type: ignore[method-assign,assignment]
    prefixes, orders = [], []
    batch = CHUNK
    try:
        for i in range(0, len(y), CHUNK):
            recorded.clear()
            batch = len(y[i : i + CHUNK])
            opts = ClassifyOptions(policy=Policy.SHUFFLE, seed=10_000 + i, exit_rule="patience", exit_threshold=1024)
            result = await coord.router.classify(x[i : i + CHUNK], opts)
            if len(recorded) != len(result.path.hops):
                raise RuntimeError(f"recorded {len(recorded)} head calls for a {len(result.path.hops)}-hop path")
            prefixes.append(torch.stack(recorded, 1))  # after hops 1..L-1, then the final head
            orders.append([h.block for h in result.path.hops if h.block is not None])
    finally:
        coord.router.head_logits = head  # type: ignore[method-assign]
    prefix = torch.cat(prefixes)
    return {
        "full_accuracy": float((prefix[:, -1].argmax(-1) == y).float().mean()),
        "rules": {rule: sweep(prefix, y, ExitRule(rule), 1) for rule in RULES},
        "orders": orders,
    }


def _agreement(member: Path, x: torch.Tensor, y: torch.Tensor, live: dict[str, Any]) -> dict[str, Any]:
    """Eval's curves on the same images against the live ones, per rule: with the orders the live paths
    took (what differs is the swarm itself: fp16 wire, gRPC, the executor), and with other random
    orders as eval draws them (adds order-to-order variation: with 50 images per order, few orders)."""
    model, manifest = load_model(member)
    with torch.inference_mode():
        stem = model.stem(x)
        other = prefix_logits(
            list(model.blocks), model.head, stem, manifest.config.shuffle_robust, random.Random(1), CHUNK
        )
        same = torch.cat(
            [_prefix_in_order(model, stem[i * CHUNK : (i + 1) * CHUNK], o) for i, o in enumerate(live["orders"])]
        )
    p = live["full_accuracy"]
    out: dict[str, Any] = {"accuracy_2se": round(2 * (p * (1 - p) / len(y)) ** 0.5, 4), "rules": {}}
    for rule in RULES:
        out["rules"][rule] = {
            name: _gaps(sweep(prefix, y, ExitRule(rule), 1), live["rules"][rule])
            for name, prefix in (("same_orders", same), ("other_orders", other))
        }
    return out


def _prefix_in_order(model: Any, h: torch.Tensor, order: list[int]) -> torch.Tensor:
    steps = []
    for position, index in enumerate(order):
        h = model.blocks[index](h, position)
        steps.append(model.head(h))
    return torch.stack(steps, 1)


def _gaps(local: list[SweepPoint], live: list[SweepPoint]) -> dict[str, float]:
    pairs = list(zip(local, live, strict=True))
    return {
        "max_accuracy_gap": round(max(abs(a["accuracy"] - b["accuracy"]) for a, b in pairs), 4),
        "mean_accuracy_gap": round(statistics.fmean(abs(a["accuracy"] - b["accuracy"]) for a, b in pairs), 4),
        "max_blocks_gap": round(max(abs(a["mean_blocks"] - b["mean_blocks"]) for a, b in pairs), 3),
    }


async def _timed(coord: Coordinator, image: torch.Tensor, opts: ClassifyOptions) -> tuple[Any, float]:
    started = time.perf_counter()
    result = await coord.router.classify(image, opts)
    return result, time.perf_counter() - started


async def _calibrated_vs_full(coord: Coordinator, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Batch 1, the same seed (so the same order) for both, interleaved in alternating order."""
    rows = _rows("full", "calibrated")
    for i in range(len(y)):
        configs = [("full", "none"), ("calibrated", None)]
        for name, rule in configs if i % 2 == 0 else configs[::-1]:
            opts = ClassifyOptions(policy=Policy.SHUFFLE, seed=i, exit_rule=rule)
            result, seconds = await _timed(coord, x[i : i + 1], opts)
            rows[name]["correct"].append(float(int(result.probs.argmax(-1)[0]) == int(y[i])))
            rows[name]["blocks"].append(result.path.depth)
            rows[name]["seconds"].append(seconds)
    out: dict[str, Any] = {name: _summary(r) for name, r in rows.items()}
    out["blocks_reduction"] = round(out["full"]["mean_blocks"] / out["calibrated"]["mean_blocks"], 3)
    out["points_lost"] = round((out["full"]["accuracy"] - out["calibrated"]["accuracy"]) * 100, 2)
    out["latency_mean_ratio"] = round(out["calibrated"]["latency_mean_ms"] / out["full"]["latency_mean_ms"], 3)
    return out


def _full_logits(model_dir: Path, images: torch.Tensor, rng: random.Random) -> torch.Tensor:
    model, manifest = load_model(model_dir)
    with torch.inference_mode():
        stem = model.stem(images)
        return prefix_logits(list(model.blocks), model.head, stem, manifest.config.shuffle_robust, rng, CHUNK)


def _noisy_ensembles(member: Path, partner: Path | None, noisy: Dataset) -> dict[str, Any]:
    """Offline, eval's code, on the whole noisy test split: the second route another order of the
    member, or the partner member. The threshold (the one the swarm uses) is calibrated on the
    calibration half for the route the swarm's default takes (members where there is a partner)."""
    rng = random.Random(0)
    images = noisy.test_x
    assert isinstance(images, torch.Tensor)  # generated data: in memory
    first = _full_logits(member, images, rng)
    other_order = _full_logits(member, images, rng)
    out: dict[str, Any] = {"orders": calibrate_ensemble(first, other_order, noisy.test_y, CalibrationPlan())}
    if partner is not None:
        second = _full_logits(partner, images, rng)
        out["members"] = calibrate_ensemble(first, second, noisy.test_y, CalibrationPlan())
        out["partner"] = partner.name
    for curve in (v for k, v in out.items() if k in ("orders", "members")):
        curve.pop("curve", None)
    chosen = out["members" if partner is not None else "orders"]["chosen"]
    out["threshold"] = float(chosen["threshold"]) if chosen else 0.9
    return out


async def _ensemble(
    coord: Coordinator, x: torch.Tensor, y: torch.Tensor, threshold: float, with_members: bool
) -> dict[str, Any]:
    """Single full paths against adaptive ensembles of up to two routes (no early exit in any), the
    second route over another order of the same model, or (with_members) over another member."""
    configs = [("single", 1, "orders"), ("adaptive_orders", 2, "orders")]
    if with_members:
        configs.append(("adaptive_members", 2, "members"))
    rows = _rows(*(name for name, _, _ in configs))
    routes: dict[str, list[int]] = {name: [] for name, k, _ in configs if k > 1}
    for i in range(len(y)):
        for name, k, over in configs:
            opts = ClassifyOptions(
                policy=Policy.SHUFFLE,
                seed=i,
                exit_rule="none",
                ensemble=k,
                ensemble_confidence=threshold,
                ensemble_over=over,
            )
            result, seconds = await _timed(coord, x[i : i + 1], opts)
            rows[name]["correct"].append(float(int(result.probs.argmax(-1)[0]) == int(y[i])))
            rows[name]["blocks"].append(sum(r.path.depth for r in result.ensemble.routes))
            rows[name]["seconds"].append(seconds)
            if k > 1:
                routes[name].append(len(result.ensemble.routes))
    out: dict[str, Any] = {name: _summary(r) for name, r in rows.items()}
    out["threshold"] = threshold
    for name, counts in routes.items():
        out[name]["second_route_share"] = round(sum(r > 1 for r in counts) / len(counts), 4)
        out[name]["points_gained"] = round((out[name]["accuracy"] - out["single"]["accuracy"]) * 100, 2)
        out[name]["hops_ratio"] = round(out[name]["mean_blocks"] / out["single"]["mean_blocks"], 3)
    return out


async def _anytime(coord: Coordinator, x: torch.Tensor, y: torch.Tensor, deadline_ms: float) -> dict[str, Any]:
    min_blocks = 2
    depths, correct, seconds, failed, marked = [], [], [], 0, 0
    for i in range(len(y)):
        opts = ClassifyOptions(
            policy=Policy.SHUFFLE, seed=i, exit_rule="none", deadline_ms=deadline_ms, min_blocks=min_blocks
        )
        try:
            result, took = await _timed(coord, x[i : i + 1], opts)
        except DepthError:
            failed += 1
            continue
        depths.append(result.path.depth)
        correct.append(float(int(result.probs.argmax(-1)[0]) == int(y[i])))
        seconds.append(took)
        marked += result.path.anytime
    return {
        "deadline_ms": round(deadline_ms, 2),
        "min_blocks": min_blocks,
        "requests": len(y),
        "answered": len(depths),
        "failed_below_min_depth": failed,
        "marked_anytime": marked,
        "accuracy": round(statistics.fmean(correct), 4) if correct else None,
        "mean_blocks": round(statistics.fmean(depths), 3) if depths else None,
        "blocks_histogram": {str(d): depths.count(d) for d in sorted(set(depths))},
        "latency_p50_ms": median_ms(seconds) if seconds else None,
        "latency_max_ms": round(max(seconds) * 1e3, 2) if seconds else None,
    }


def _rows(*names: str) -> dict[str, dict[str, list[float]]]:
    return {name: {"correct": [], "blocks": [], "seconds": []} for name in names}


def _summary(rows: dict[str, list[float]]) -> dict[str, float]:
    return {
        "accuracy": round(statistics.fmean(rows["correct"]), 4),
        "mean_blocks": round(statistics.fmean(rows["blocks"]), 3),
        "latency_p50_ms": median_ms(rows["seconds"]),
        "latency_mean_ms": round(statistics.fmean(rows["seconds"]) * 1e3, 3),
    }
