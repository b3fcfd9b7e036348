"""`layerswarm bench`: every benchmark in one run, JSON plus a markdown table.

Timings on a shared 2-core machine move by tens of percent between runs, so every figure that
matters is a ratio against a baseline measured in the same run, interleaved where it can be.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import torch

from layerswarm.harness.samples import task_data
from layerswarm.models.zoo import family_root, robust_members
from layerswarm.wire.memory import keep_large_buffers

from . import (
    activations,
    adaptive,
    anytime_default,
    decode_node,
    edgelan,
    exit_default,
    generation,
    generation_modes,
    hop,
    loadbalancer,
    process_ring,
    shipped,
    token_time,
    vitb,
)
from . import nodes as node_footprint
from .fixtures import nodes, vitb_model_dir
from .machine import environment
from .report import render

T = TypeVar("T")


class _Loop:
    """What asyncio.Runner (Python 3.11) does, for 3.10 too: one event loop that runs coroutine after
    coroutine, then shuts down its async generators and executor and closes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            self.loop.close()


@functools.cache
def _loop() -> _Loop:
    """One event loop for the whole run. grpc.aio binds every loop that ever used it to its poller and
    keeps waking them all; a loop closed by an earlier asyncio.run then gets grpc's late events and logs
    "Event loop is closed" (grpc/grpc#25364)."""
    return _Loop()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return _loop().run(coro)


def adaptive_members() -> list[tuple[Path, Path | None]]:
    """The shipped family's first LayerShuffle member, and the exit-aware member where it is shipped,
    each with the member its ensembles route over (the next LayerShuffle member; the first for the
    exit-aware one)."""
    robust = robust_members(family_root())
    partner = robust[1] if len(robust) > 1 else None
    members: list[tuple[Path, Path | None]] = [(robust[0], partner)]
    exit_aware = family_root("shapes-exit")
    if exit_aware.is_dir():
        members += [(m, robust[0]) for m in robust_members(exit_aware)]
    return members


def run_adaptive(quick: bool) -> dict[str, Any]:
    return _run(adaptive.run(adaptive_members(), 60 if quick else 300))


EXIT_FAMILIES = ("shapes", "text")  # the shipped classifier families: images and text


def run_exit_default(quick: bool) -> dict[str, Any]:
    """Each shipped family with default options against itself at full depth (its first LayerShuffle
    member's nodes and policy)."""
    families = [(name, robust_members(family_root(name))[0]) for name in EXIT_FAMILIES]
    return _run(exit_default.run(families, 100 if quick else 500))


def run_anytime_default(quick: bool) -> dict[str, Any]:
    """Each shipped family with default options and only a deadline set, over a sweep of deadlines."""
    families = [(name, robust_members(family_root(name))[0]) for name in EXIT_FAMILIES]
    return _run(anytime_default.run(families, 30 if quick else 300))


def run_wire_formats(quick: bool, reps: int) -> list[dict[str, Any]]:
    """Accuracy, bytes and latency of every wire format through a swarm of the shipped family."""
    members = robust_members(family_root())[:2]
    with nodes(shipped.layout(members)) as procs:
        return _run(shipped.wire_formats(members, procs, 500 if quick else 2000, reps * 4))


def run_activation_forms(quick: bool) -> list[dict[str, Any]]:
    """int8 error and zlib's ratio on real activations: the shipped family's (trained, its test images)
    and ViT-B/16's shape (random weights, random images)."""
    member = robust_members(family_root())[0]
    images = task_data(member).test_x[: 16 if quick else 128]
    rows = [activations.measure(member, images, f"shipped ({member.name})")]
    with tempfile.TemporaryDirectory(prefix="layerswarm-bench-") as tmp:
        torch.manual_seed(0)
        rows.append(activations.measure(vitb_model_dir(Path(tmp)), torch.rand(2, 3, 224, 224), "ViT-B/16 shape"))
    return rows


def run_int8_accuracy(quick: bool) -> list[dict[str, Any]]:
    member = robust_members(family_root())[0]
    data = task_data(member)
    count = 500 if quick else 2000
    return activations.accuracy_by_wire(member, data.test_x[:count], data.test_y[:count])


def run_vitb(quick: bool, reps: int) -> dict[str, Any]:
    """The ViT-B/16-shaped swarm (12 nodes on loopback) against the monolith: latency, throughput, one
    hop, the coordinator's CPU; on a CUDA machine the latency again with CUDA nodes."""
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="layerswarm-bench-") as tmp:
        model_dir = vitb_model_dir(Path(tmp))
        with nodes([(model_dir, b) for b in range(12)]) as procs:
            configs = [("fp32", "unary"), ("fp32", "stream"), ("fp16", "unary"), ("fp16", "stream")]
            report["vitb_swarm_vs_monolith"] = _run(vitb.swarm_vs_monolith(model_dir, procs, reps, configs))
            report["hop_vs_floor"] = _run(hop.hop_vs_floor(model_dir, procs[0], reps))
            report["vitb_throughput"] = _run(vitb.concurrent_throughput(model_dir, procs, 16, 2 if quick else 6))
            if not quick:  # the same with each spot check blocking its hop: what deferring them costs or saves
                report["vitb_throughput_blocking_checks"] = _run(
                    vitb.concurrent_throughput(model_dir, procs, 16, 6, deferred_checks=False)
                )
            report["vitb_idle_vs_busy"] = _run(vitb.idle_vs_busy_compute(model_dir, procs, 2 if quick else 6))
            report["coordinator_cost_vitb"] = vitb.coordinator_cpu_share(model_dir, procs, 3 if quick else 10, 224)
        # Relay chains need a swarm token: a second set of nodes with one keeps the runs above as they were.
        token = Path(tmp) / "swarm.token"
        token.write_text(secrets.token_hex(16) + "\n")
        with nodes([(model_dir, b) for b in range(12)], "--token-file", str(token)) as procs:
            report["vitb_throughput_relay"] = _run(
                vitb.concurrent_throughput(model_dir, procs, 16, 2 if quick else 6, topology="relay", token_file=token)
            )
    if torch.cuda.is_available():  # the same figures on the GPU, where there is one; never required
        report["cuda"] = run_cuda(quick, reps)
    return report


def run_cuda(quick: bool, reps: int) -> dict[str, Any]:
    """The loopback figures again with 12 CUDA nodes sharing one GPU, against the monolith on the same
    GPU: latency at batch 1, throughput at 16 concurrent, and one hop (its copies to and from the GPU
    included) against the TCP floor."""
    report: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    with tempfile.TemporaryDirectory(prefix="layerswarm-bench-") as tmp:
        model_dir = vitb_model_dir(Path(tmp))
        with nodes([(model_dir, b) for b in range(12)], "--device", "cuda") as procs:
            configs = [("fp32", "stream"), ("fp16", "stream")]
            report["vitb_swarm_vs_monolith"] = _run(
                vitb.swarm_vs_monolith(model_dir, procs, reps, configs, device="cuda")
            )
            rounds = 2 if quick else 6
            report["vitb_throughput"] = _run(vitb.concurrent_throughput(model_dir, procs, 16, rounds, device="cuda"))
            # The coordinator re-executes its spot checks on its own CPU: against GPU nodes that may be
            # what limits throughput, so the same rounds again without them.
            report["vitb_throughput_no_spot_checks"] = _run(
                vitb.concurrent_throughput(model_dir, procs, 16, rounds, device="cuda", spot_checks=False)
            )
            report["hop_vs_floor"] = _run(hop.hop_vs_floor(model_dir, procs[0], reps))
    return report


def run_process_ring(quick: bool) -> dict[str, Any]:
    """ViT-B/16's blocks in a ring of processes over pipes against the same blocks in one loop."""
    with tempfile.TemporaryDirectory(prefix="layerswarm-bench-") as tmp:
        return process_ring.run(vitb_model_dir(Path(tmp)), 5 if quick else 30)


def run_decode_node(quick: bool) -> dict[str, Any]:
    """One decoder node: a stream's step latency against 16 concurrent streams' throughput."""
    with tempfile.TemporaryDirectory(prefix="layerswarm-bench-") as tmp:
        return decode_node.run(Path(tmp), quick)


SUITES_ALONE: dict[str, tuple[str, Callable[[bool], dict[str, Any]]]] = {
    "decode-node": ("decode_node", run_decode_node),
    "generation": ("generation", generation.run),
    "generation-modes": ("generation_modes", generation_modes.run),
    "token-time": ("token_time", token_time.run),
    "load-balancer": ("load_balancer", loadbalancer.run),
    "adaptive": ("adaptive", run_adaptive),
    "exit-default": ("exit_default", run_exit_default),
    "anytime-default": ("anytime_default", run_anytime_default),
    "edge-lan": ("edge_lan", edgelan.run),
    "process-ring": ("process_ring", run_process_ring),
}


def run(quick: bool, only: str | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    reps = 5 if quick else 20
    report: dict[str, Any] = {"quick": quick, "environment": environment()}
    alone = SUITES_ALONE.get(only or "")
    if alone is not None:  # a suite that runs by itself: its report key and what makes it
        key, suite = alone
        report[key] = suite(quick)
        report["seconds"] = round(time.perf_counter() - started, 1)
        return report
    if only == "hop":
        with tempfile.TemporaryDirectory(prefix="layerswarm-bench-") as tmp:
            model_dir = vitb_model_dir(Path(tmp))
            with nodes([(model_dir, 0)]) as procs:
                report["hop_vs_floor"] = _run(hop.hop_vs_floor(model_dir, procs[0], reps * 2))
        report["seconds"] = round(time.perf_counter() - started, 1)
        return report
    if only == "cuda":
        report["cuda"] = run_cuda(quick, reps)
        report["seconds"] = round(time.perf_counter() - started, 1)
        return report
    if only == "wire":
        report["wire_formats"] = run_wire_formats(quick, reps)
        report["activation_forms"] = run_activation_forms(quick)
        report["wire_accuracy_in_process"] = run_int8_accuracy(quick)
        report["seconds"] = round(time.perf_counter() - started, 1)
        return report
    report.update(run_vitb(quick, reps))
    report["process_ring"] = run_process_ring(quick)
    if only == "vitb":
        report["vitb_swarm_vs_monolith_ratio"] = report["vitb_swarm_vs_monolith"]["ratio_fp16_stream"]
        report["seconds"] = round(time.perf_counter() - started, 1)
        return report
    members = robust_members(family_root())[:2]
    with nodes(shipped.layout(members)) as procs:
        report["wire_formats"] = _run(shipped.wire_formats(members, procs, 500 if quick else 2000, reps * 4))
        report["coordinator_cost_shipped"] = vitb.coordinator_cpu_share(members[0], procs, 50 if quick else 200, 32)
    report["activation_forms"] = run_activation_forms(quick)
    report["wire_accuracy_in_process"] = run_int8_accuracy(quick)
    report["concurrency"] = _run(shipped.concurrency(members, [1, 4, 16, 64], 64 if quick else 256))
    report["adaptive"] = run_adaptive(quick)
    report["exit_default"] = run_exit_default(quick)
    report["node_footprint"] = node_footprint.node_footprint(2 if quick else 5)
    report["decode_node"] = run_decode_node(quick)
    report["load_balancer"] = loadbalancer.run(quick)
    report["edge_lan"] = edgelan.run(quick)  # star vs relay on a shaped LAN (namespaces; needs root)
    headline = report["vitb_swarm_vs_monolith"]
    report["vitb_swarm_vs_monolith_ratio"] = headline["ratio_fp16_stream"]  # the default configuration
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def main(quick: bool, json_path: Path | None, markdown_path: Path | None, only: str | None = None) -> int:
    keep_large_buffers()  # as the node and coordinator processes do: this process is a coordinator
    try:
        report = run(quick, only)
    finally:
        _loop().close()
        _loop.cache_clear()
    text = render(report)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    if markdown_path:
        markdown_path.write_text(text + "\n")
    print(text)
    return 0
