"""The shipped family's shape: wire formats (bytes, latency, accuracy through the swarm) and
throughput under concurrency through the HTTP endpoint, with node micro-batching on and off."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from layerswarm.coordinator import ClassifyOptions, Policy
from layerswarm.harness.procs import Proc, stop_all
from layerswarm.harness.samples import labelled_samples, task_data
from layerswarm.models.checkpoint import read_manifest

from .fixtures import addresses, coordinator_process, median_ms, nodes, percentile_ms
from .vitb import coordinator


def layout(members: list[Path]) -> list[tuple[Path, int]]:
    depth = read_manifest(members[0]).config.depth
    return [(m, b) for m in members for b in range(depth)]


async def wire_formats(members: list[Path], procs: list[Proc], images: int, reps: int) -> list[dict[str, Any]]:
    manifest = read_manifest(members[0])
    data = task_data(members[0])
    x, y = data.test_x[:images], data.test_y[:images]
    cfg = manifest.config
    rows: list[dict[str, Any]] = []
    for wire in ("fp32", "fp16", "bf16", "int8"):
        coord = coordinator(members[0], addresses(procs), wire, "stream")
        await coord.start()
        try:
            correct = 0
            for i in range(0, len(y), 50):  # the same seeds, so the same paths, for every wire format
                result = await coord.router.classify(
                    x[i : i + 50], ClassifyOptions(policy=Policy.SHUFFLE, seed=i, exit_rule="none")
                )
                correct += int((result.probs.argmax(-1) == y[i : i + 50]).sum())
            latencies = []
            for i in range(reps):
                started = time.perf_counter()
                await coord.router.classify(x[i : i + 1], ClassifyOptions(policy=Policy.SHUFFLE, seed=i))
                latencies.append(time.perf_counter() - started)
        finally:
            await coord.stop()
        itemsize = torch.empty((), dtype=coord.router.wire.dtype).element_size()
        scales = cfg.num_tokens * 4 if wire == "int8" else 0  # one float32 scale per token
        rows.append(
            {
                "wire_dtype": wire,
                "bytes_per_hop": cfg.num_tokens * cfg.dim * itemsize + scales,
                "accuracy": round(correct / len(y), 4),
                "images": len(y),
                "latency_p50_ms": median_ms(latencies),
            }
        )
    for row in rows:
        row["points_lost"] = round((rows[0]["accuracy"] - row["accuracy"]) * 100, 2)
    return rows


async def concurrency(members: list[Path], levels: list[int], requests: int) -> list[dict[str, Any]]:
    """Both swarms (node micro-batching on and off) run side by side; each level measures one, then the
    other, in alternating order, so drift on a shared machine hits both alike."""
    images = [sample.png for sample in labelled_samples(task_data(members[0]), range(64))]
    rows = []
    with (
        nodes(layout(members), "--max-in-flight", "256") as on,
        nodes(layout(members), "--max-in-flight", "256", "--no-micro-batch") as off,
    ):
        coords = {True: coordinator_process(members[0], on), False: coordinator_process(members[0], off)}
        try:
            for i, level in enumerate(levels):
                for micro_batch in (True, False) if i % 2 == 0 else (False, True):
                    url = f"http://127.0.0.1:{coords[micro_batch].ready['port']}"
                    row = await _load(url, images, level, requests)
                    rows.append({"micro_batching": micro_batch, "concurrency": level, **row})
        finally:
            stop_all(list(coords.values()))
    rows.sort(key=lambda r: (not r["micro_batching"], r["concurrency"]))
    base = {r["micro_batching"]: r["throughput_rps"] for r in rows if r["concurrency"] == levels[0]}
    for row in rows:
        row["throughput_vs_1"] = round(row["throughput_rps"] / base[row["micro_batching"]], 3)
    return rows


async def _load(url: str, images: list[bytes], level: int, requests: int) -> dict[str, Any]:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    queue = list(range(min(8, requests)))  # warm-up first
    limits = httpx.Limits(max_connections=level, max_keepalive_connections=level)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                started = time.perf_counter()
                reply = await client.post(
                    "/v1/classify", files={"file": ("x.png", images[i % len(images)], "image/png")}
                )
                latencies.append(time.perf_counter() - started)
                statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1

        await asyncio.gather(*(worker() for _ in range(min(level, 4))))  # warm the connections
        latencies.clear()
        statuses.clear()
        queue.extend(range(requests))
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(level)))
        elapsed = time.perf_counter() - started
    return {
        "requests": requests,
        "statuses": statuses,
        "throughput_rps": round(requests / elapsed, 2),
        "latency_p50_ms": median_ms(latencies),
        "latency_p99_ms": percentile_ms(latencies, 0.99),
    }
