"""Helpers for tests that start real node processes on loopback."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

from layerswarm.coordinator import Coordinator, CoordinatorSettings
from layerswarm.harness.procs import Proc, coordinator_cmd, node_address, node_cmd, spawn, spawn_many


def start_nodes(layout: list[tuple[Path, int]], *extra: str, faults: tuple[str, ...] = ()) -> list[Proc]:
    """One node process per (model dir, block); with `faults` (--fault-* arguments), the test-only
    faulty node of harness/faults.py instead of `layerswarm node`."""
    quick = ("--no-advertise", "--grace", "0.5", *extra)
    cmds = [(f"node-{d.name}-{b}", node_cmd(d, b, *quick)) for d, b in layout]
    if faults:  # node_cmd is [python, -m, layerswarm, node, ...]: keep the node's own arguments
        cmds = [(name, [sys.executable, "-m", "layerswarm.harness.faults", *cmd[4:], *faults]) for name, cmd in cmds]
    return spawn_many(cmds)


def restart_node(model_dir: Path, block: int, port: int) -> Proc:
    cmd = node_cmd(model_dir, block, "--no-advertise", "--grace", "0.5", port=port)
    return spawn(f"node-{model_dir.name}-{block}-again", cmd)


def address(proc: Proc) -> str:
    return node_address(proc)


def coordinator(model_dir: Path, nodes: list[Proc], **overrides: object) -> Coordinator:
    values: dict[str, object] = {
        "health_interval_s": 0.2,
        "health_timeout_s": 0.3,
        "hop_timeout_s": 1.0,
        "wire_dtype": "fp32",
        **overrides,
    }  # fp32: outputs comparable bit for bit
    settings = CoordinatorSettings(model_dir=model_dir, peers=tuple(address(n) for n in nodes), mdns=False, **values)  # type: ignore[arg-type]
    return Coordinator(settings)


async def wait_until(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def states(coord: Coordinator) -> dict[str, str]:
    return {a: r.state.value for a, r in coord.registry.nodes.items()}


def coordinator_process(model_dir: Path, nodes: list[Proc], *extra: str) -> Proc:
    """A real coordinator process on a free HTTP port with `nodes` as static peers."""
    return spawn("coordinator", coordinator_cmd(model_dir, nodes, *extra))
