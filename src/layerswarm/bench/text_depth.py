"""Per-token depth through a real swarm: one node process per block on loopback, batch-1 requests
from a text model's test split, full depth vs the MI and reconstruction estimates, in sequential and
shuffled order, with frozen tokens in the wire's dtype (fp16, the default) or apart as int8
(`--frozen-dtype`). Per request: accuracy, latency, hops, tokens computed and tensor bytes on the wire
(request: every real token's state and the mask; reply: the updated tokens only). Ratios are against
full depth measured in the same run. Run by `layerswarm depth --swarm N`.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, Policy
from layerswarm.harness.procs import node_address, node_cmd, spawn_many, stop_all
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.text.depth import DEPTH_POLICY, token_depths
from layerswarm.models.text.tokenizer import PAD_ID
from layerswarm.training.text.data import load_text_data


def run_swarm_bench(model_dir: Path, requests: int, seed: int = 0) -> dict[str, Any]:
    manifest = read_manifest(model_dir)
    data = load_text_data(str(manifest.dataset["spec"]), model_dir)
    assert isinstance(data.test_x, torch.Tensor)
    ids = [row[row != PAD_ID][None, :] for row in data.test_x[:requests]]  # batch 1, no padding
    labels = data.test_y[:requests].tolist()
    cmds = [
        (f"text-node-{b}", node_cmd(model_dir, b, "--no-advertise", "--grace", "0.5"))
        for b in range(manifest.config.depth)
    ]
    nodes = spawn_many(cmds)
    try:
        return asyncio.run(_measure(model_dir, [node_address(n) for n in nodes], ids, labels, manifest.policy, seed))
    finally:
        stop_all(nodes)


# (row name, token-depth estimate, how frozen tokens travel): full depth has none frozen, so one row
ROWS = (
    ("full", "full", "wire"),
    ("mi", "mi", "wire"),
    ("reconstruction", "reconstruction", "wire"),
    ("mi+frozen-int8", "mi", "int8"),
    ("reconstruction+frozen-int8", "reconstruction", "int8"),
)


async def _measure(
    model_dir: Path, peers: list[str], ids: list[torch.Tensor], labels: list[int], policy: dict[str, Any], seed: int
) -> dict[str, Any]:
    """Each row through its own coordinator (the wire is the default, fp16; --frozen-dtype per row),
    interleaved request by request so that load on the machine hits every row alike."""
    coords = {}
    for frozen in ("wire", "int8"):
        settings = CoordinatorSettings(model_dir=model_dir, peers=tuple(peers), mdns=False, frozen_dtype=frozen)
        coords[frozen] = Coordinator(settings)
        await coords[frozen].start()
        await coords[frozen].watch.wait_first_round(10.0)
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, no GPU",
        "requests": len(ids),
        "wire_dtype": "fp16",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        for coord in coords.values():  # warm-up, not counted
            await _one_request(coord, ids[0], labels[0], policy, "full", Policy.SEQUENTIAL, seed)
        for order in (Policy.SEQUENTIAL, Policy.SHUFFLE):
            runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in ROWS}
            for i, (x, label) in enumerate(zip(ids, labels, strict=True)):
                for name, mode, frozen in ROWS:
                    runs[name].append(await _one_request(coords[frozen], x, label, policy, mode, order, seed + i))
            rows = {name: _summary(r) for name, r in runs.items()}
            full = rows["full"]
            for row in rows.values():
                row["tokens_reduction"] = round(full["tokens_per_request"] / row["tokens_per_request"], 3)
                row["bytes_reduction"] = round(full["wire_bytes_per_request"] / row["wire_bytes_per_request"], 3)
                row["latency_speedup"] = round(full["latency_ms_mean"] / row["latency_ms_mean"], 3)
                row["accuracy_change_points"] = round((row["accuracy"] - full["accuracy"]) * 100, 2)
            results.update({f"{order.value}/{name}": row for name, row in rows.items()})
    finally:
        for coord in coords.values():
            await coord.stop()
    return results


async def _one_request(
    coord: Coordinator, x: torch.Tensor, label: int, policy: dict[str, Any], mode: str, order: Policy, seed: int
) -> dict[str, float]:
    depth = None if mode == "full" else token_depths(policy.get(DEPTH_POLICY), mode, x)
    deepest = None if depth is None else int(depth.max())
    opts = ClassifyOptions(policy=order, seed=seed, token_depth=depth, max_blocks=deepest, min_blocks=deepest)
    started = time.perf_counter()
    result = await coord.router.classify(x, opts)
    return {
        "latency_ms": (time.perf_counter() - started) * 1e3,
        "correct": float(result.probs.argmax(-1).item() == label),
        "tokens": float(sum(h.tokens or 0 for h in result.path.hops)),
        "wire_bytes": float(sum(h.wire_bytes or 0 for h in result.path.hops)),
        "hops": float(result.path.depth),
    }


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    def col(key: str) -> list[float]:
        return [r[key] for r in runs]

    return {
        "accuracy": round(statistics.fmean(col("correct")), 4),
        "latency_ms_mean": round(statistics.fmean(col("latency_ms")), 3),
        "latency_ms_median": round(statistics.median(col("latency_ms")), 3),
        "hops_per_request": round(statistics.fmean(col("hops")), 3),
        "tokens_per_request": round(statistics.fmean(col("tokens")), 3),
        "wire_bytes_per_request": round(statistics.fmean(col("wire_bytes")), 1),
    }
