"""What a user gets without asking (issue 42): each shipped family through a live swarm with default
options, against the same family forced to full depth, in the same run.

Per family (images: `shapes`, text: `text`), its first LayerShuffle member's nodes (one per block, loopback,
static peers), an in-process coordinator with default settings (so the exit rule, its threshold and floor
come from the member's adaptive.json, as `layerswarm eval --calibrate` wrote it), batch-1 requests from
the held-out half of the test split (calibration chose its thresholds on the other half). Each request
runs twice, full depth (`exit_rule=none`) and default, interleaved in alternating order, with the same
seed and so the same order of blocks: accuracy, blocks run, latency.

Then eval's side on the same requests: the same model run in process with eval's code (prefix logits,
`models/exits.simulate`, the same rule, threshold and floor), once in the orders the live paths took
(what differs is the swarm itself: fp16 wire, gRPC) and in ORDER_DRAWS sets of eval's own random orders (an
order per request, as calibration draws them), whose mean is what eval expects of any order: accuracy and
mean blocks against the live default's, and the spread from one set of orders to the next.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings
from layerswarm.coordinator.routing.exits import AdaptiveDefaults
from layerswarm.harness.samples import task_data
from layerswarm.models.checkpoint import load_model, read_manifest
from layerswarm.models.exits import simulate
from layerswarm.models.text.specials import PAD_ID
from layerswarm.training.evaluation.calibrate import prefix_logits

from .fixtures import addresses, median_ms, nodes
from .shipped import layout

WARM_UP = 3  # requests per configuration before the measured ones (a new node's first hops are checked)
# Sets of eval's random orders the live default is compared with: one set's accuracy moves by a point or
# two from the next on 500 requests (the orders' own spread), so one draw says little about "any order".
ORDER_DRAWS = 8


async def run(families: list[tuple[str, Path]], requests: int) -> dict[str, Any]:
    """families: (family name, the member whose nodes and policy serve it)."""
    return {"requests": requests, "families": {name: await _family(member, requests) for name, member in families}}


def held_out(member: Path, requests: int) -> tuple[list[torch.Tensor], list[int], int]:
    """Batch-1 inputs (text: the sentence's tokens without padding, as the HTTP API sends them), their
    labels, and the index of the first one in the test split."""
    data = task_data(member)
    assert isinstance(data.test_x, torch.Tensor)  # generated data: in memory
    first = len(data.test_y) // 2
    rows = data.test_x[first : first + requests]
    text = read_manifest(member).config.is_text
    inputs = [row[row != PAD_ID][None, :] if text else row[None] for row in rows]
    return inputs, data.test_y[first : first + requests].tolist(), first


async def _family(member: Path, requests: int) -> dict[str, Any]:
    inputs, labels, first = held_out(member, requests)
    with nodes(layout([member])) as procs:
        coord = Coordinator(CoordinatorSettings(model_dir=member, peers=addresses(procs), mdns=False))
        await coord.start()
        try:
            adaptive = coord.router.adaptive
            depth_rule = coord.router.depth_rule.to_json()
            for i in range(WARM_UP):
                for opts in _configs(i).values():
                    await coord.router.classify(inputs[i], opts)
            rows, orders = await _interleaved(coord, inputs, labels)
        finally:
            await coord.stop()
    full, default = _summary(rows["full"]), _summary(rows["default"])
    return {
        "member": f"{member.parent.name}/{member.name}",
        "model_id": read_manifest(member).model_id,
        "test_indices": [first, first + len(labels)],
        "policy": adaptive.to_json(),
        "depth_rule": depth_rule,
        "full": full,
        "default": default,
        "blocks_reduction": round(full["mean_blocks"] / default["mean_blocks"], 3),
        "points_lost": round((full["accuracy"] - default["accuracy"]) * 100, 2),
        "latency_mean_ratio": round(default["latency_mean_ms"] / full["latency_mean_ms"], 3),
        "eval_vs_live": _eval_vs_live(member, inputs, labels, orders, rows["default"], adaptive),
    }


def _configs(seed: int) -> dict[str, ClassifyOptions]:
    """Full depth and the defaults: the same seed, so the same order of blocks."""
    return {"full": ClassifyOptions(seed=seed, exit_rule="none"), "default": ClassifyOptions(seed=seed)}


async def _interleaved(
    coord: Coordinator, inputs: list[torch.Tensor], labels: list[int]
) -> tuple[dict[str, list[dict[str, float]]], list[list[int]]]:
    rows: dict[str, list[dict[str, float]]] = {"full": [], "default": []}
    orders: list[list[int]] = []
    for i, (x, label) in enumerate(zip(inputs, labels, strict=True)):
        configs = list(_configs(i).items())
        for name, opts in configs if i % 2 == 0 else configs[::-1]:
            started = time.perf_counter()
            result = await coord.router.classify(x, opts)
            seconds = time.perf_counter() - started
            answer = int(result.probs.argmax(-1)[0])
            rows[name].append(
                {
                    "correct": float(answer == label),
                    "answer": float(answer),
                    "blocks": float(result.path.depth),
                    "exited": float(result.path.exited_early),
                    "seconds": seconds,
                }
            )
            if name == "full":
                orders.append([h.block for h in result.path.hops if h.block is not None])
    return rows, orders


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    blocks = [int(r["blocks"]) for r in rows]
    seconds = [r["seconds"] for r in rows]
    return {
        "accuracy": round(statistics.fmean(r["correct"] for r in rows), 4),
        "mean_blocks": round(statistics.fmean(blocks), 3),
        "exited_share": round(statistics.fmean(r["exited"] for r in rows), 4),
        "blocks_histogram": {str(d): blocks.count(d) for d in sorted(set(blocks))},
        "latency_p50_ms": median_ms(seconds),
        "latency_mean_ms": round(statistics.fmean(seconds) * 1e3, 3),
    }


@torch.inference_mode()
def _eval_vs_live(
    member: Path,
    inputs: list[torch.Tensor],
    labels: list[int],
    orders: list[list[int]],
    live: list[dict[str, float]],
    adaptive: AdaptiveDefaults,
) -> dict[str, Any]:
    """eval's code on the same requests against the live default: in the live paths' orders, and in
    ORDER_DRAWS sets of eval's own random orders (an order per request each), whose mean is what eval's
    calibration expects of a swarm that routes in any order, and whose spread is the orders' own."""
    model, manifest = load_model(member)
    blocks, head = list(model.blocks), model.head
    rng = random.Random(0)
    y = torch.tensor(labels)
    live_answers = torch.tensor([int(r["answer"]) for r in live])
    live_blocks = torch.tensor([int(r["blocks"]) for r in live])
    live_accuracy = float((live_answers == y).float().mean())

    def scored(rows: list[torch.Tensor]) -> dict[str, float]:
        prefix = torch.cat(rows)
        if adaptive.exit is None:
            depth, logits = torch.full((len(y),), prefix.shape[1]), prefix[:, -1]
        else:
            depth, logits = simulate(prefix, adaptive.exit, adaptive.exit_min_blocks)
        answers = logits.argmax(-1)
        return {
            "accuracy": float((answers == y).float().mean()),
            "mean_blocks": float(depth.float().mean()),
            "same_answer_share": float((answers == live_answers).float().mean()),
            "same_blocks_share": float((depth == live_blocks).float().mean()),
        }

    robust = manifest.config.shuffle_robust
    same = scored([_prefix_in_order(blocks, head, model.stem(x), o) for x, o in zip(inputs, orders, strict=True)])
    draws = [
        scored([prefix_logits(blocks, head, model.stem(x), robust, rng, 1) for x in inputs]) for _ in range(ORDER_DRAWS)
    ]
    mean = {k: statistics.fmean(d[k] for d in draws) for k in same}
    accuracies = [d["accuracy"] for d in draws]
    out: dict[str, Any] = {
        "live": {"accuracy": round(live_accuracy, 4), "mean_blocks": round(float(live_blocks.float().mean()), 3)}
    }
    for name, row in (("same_orders", same), ("eval_orders", mean)):
        out[name] = {k: round(v, 4 if k != "mean_blocks" else 3) for k, v in row.items()}
        out[name]["accuracy_gap_points"] = round(abs(row["accuracy"] - live_accuracy) * 100, 2)
    out["eval_orders"] |= {
        "draws": ORDER_DRAWS,
        "draw_accuracies": [round(a, 4) for a in accuracies],
        "draw_accuracy_std_points": round(statistics.stdev(accuracies) * 100, 2),
        "first_draw_gap_points": round(abs(accuracies[0] - live_accuracy) * 100, 2),
    }
    return out


def _prefix_in_order(blocks: list[Any], head: Any, h: torch.Tensor, order: list[int]) -> torch.Tensor:
    """(1, L, classes): the head after every hop of one request in the order its live path took."""
    steps = []
    for position, index in enumerate(order):
        h = blocks[index](h, position)
        steps.append(head(h))
    return torch.stack(steps, 1)
