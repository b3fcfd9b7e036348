"""Per-token depth through a real swarm: one node process per block on loopback, batch-1 requests
from a text model's test split, full depth vs the MI and reconstruction estimates, in sequential and
shuffled order. Per request: accuracy, latency, hops, tokens computed and tensor bytes on the wire
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

from layerswarm.coordinator.core import ClassifyOptions, Coordinator
from layerswarm.coordinator.planner import Policy
from layerswarm.coordinator.settings import CoordinatorSettings
from layerswarm.harness.procs import node_address, node_cmd, spawn_many, stop_all
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.text.commands import load_text_data
from layerswarm.models.text.depth import DEPTH_POLICY, token_depths
from layerswarm.models.text.tokenizer import PAD_ID

MODES = ("full", "mi", "reconstruction")


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


async def _measure(
    model_dir: Path, peers: list[str], ids: list[torch.Tensor], labels: list[int], policy: dict[str, Any], seed: int
) -> dict[str, Any]:
    settings = CoordinatorSettings(model_dir=model_dir, peers=tuple(peers), mdns=False, wire_dtype="fp32")
    coord = Coordinator(settings)
    await coord.start()
    await coord.wait_first_round(10.0)
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, no GPU",
        "requests": len(ids),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        await _one_mode(coord, ids[:3], labels[:3], policy, "full", Policy.SEQUENTIAL, seed)  # warm-up, not counted
        for policy_name in ("sequential", "shuffle"):
            for mode in MODES:
                results[f"{policy_name}/{mode}"] = await _one_mode(
                    coord, ids, labels, policy, mode, Policy(policy_name), seed
                )
            full = results[f"{policy_name}/full"]
            for mode in MODES:
                row = results[f"{policy_name}/{mode}"]
                row["tokens_reduction"] = round(full["tokens_per_request"] / row["tokens_per_request"], 3)
                row["bytes_reduction"] = round(full["wire_bytes_per_request"] / row["wire_bytes_per_request"], 3)
                row["latency_speedup"] = round(full["latency_ms_mean"] / row["latency_ms_mean"], 3)
    finally:
        await coord.stop()
    return results


async def _one_mode(
    coord: Coordinator,
    ids: list[torch.Tensor],
    labels: list[int],
    policy: dict[str, Any],
    mode: str,
    order: Policy,
    seed: int,
) -> dict[str, Any]:
    correct, latencies, tokens, wire, hops = 0, [], [], [], []
    for i, (x, label) in enumerate(zip(ids, labels, strict=True)):
        depth = None if mode == "full" else token_depths(policy.get(DEPTH_POLICY), mode, x)
        deepest = None if depth is None else int(depth.max())
        opts = ClassifyOptions(policy=order, seed=seed + i, token_depth=depth, max_blocks=deepest, min_blocks=deepest)
        started = time.perf_counter()
        result = await coord.classify(x, opts)
        latencies.append((time.perf_counter() - started) * 1e3)
        correct += int(result.probs.argmax(-1).item() == label)
        tokens.append(sum(h.tokens or 0 for h in result.path.hops))
        wire.append(sum(h.wire_bytes or 0 for h in result.path.hops))
        hops.append(result.path.depth)
    return {
        "accuracy": round(correct / len(labels), 4),
        "latency_ms_mean": round(statistics.fmean(latencies), 3),
        "latency_ms_median": round(statistics.median(latencies), 3),
        "hops_per_request": round(statistics.fmean(hops), 3),
        "tokens_per_request": round(statistics.fmean(tokens), 3),
        "wire_bytes_per_request": round(statistics.fmean(wire), 1),
    }
