"""What the benchmarks share: model directories, node processes, timing and CPU accounting."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from layerswarm.harness.procs import Proc, coordinator_cmd, node_address, node_cmd, spawn, spawn_many, stop_all
from layerswarm.harness.swarm import wait_for_swarm
from layerswarm.models.checkpoint import Lineage, save_model
from layerswarm.models.config import ViTConfig
from layerswarm.models.vit import ViT
from layerswarm.wire.stats import quantile

VITB: dict[str, Any] = {"image_size": 224, "patch_size": 16, "dim": 768, "depth": 12, "heads": 12, "num_classes": 1000}


def vitb_model_dir(root: Path) -> Path:
    """ViT-B/16's shape with random weights (the benchmark measures time, not accuracy)."""
    out = root / "vitb16-random"
    if not (out / "manifest.json").is_file():
        torch.manual_seed(0)
        save_model(ViT(ViTConfig(**VITB, variant="layershuffle", pos_embed_init_std=0.02)), out, Lineage())
    return out


@contextmanager
def nodes(layout: list[tuple[Path, int]], *extra: str) -> Iterator[list[Proc]]:
    """One node process per (model dir, block), one compute thread each, static addresses."""
    specs = [
        (f"bench-node-{i}", node_cmd(d, b, "--no-advertise", "--grace", "0.2", *extra))
        for i, (d, b) in enumerate(layout)
    ]
    procs = spawn_many(specs, timeout=180)
    try:
        yield procs
    finally:
        stop_all(procs)


def addresses(procs: list[Proc]) -> tuple[str, ...]:
    return tuple(node_address(p) for p in procs)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def percentile_ms(samples: list[float], q: float) -> float:
    return round(quantile(samples, q) * 1e3, 3)


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def coordinator_process(model_dir: Path, procs: list[Proc], *extra: str) -> Proc:
    """A coordinator process (HTTP on a free port) with `procs` as static peers, ready to serve."""
    coord = spawn("bench-coordinator", coordinator_cmd(model_dir, procs, *extra), timeout=120)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}") as client:
            wait_for_swarm(client, timeout_s=60)
    except Exception:
        stop_all([coord])
        raise
    return coord
