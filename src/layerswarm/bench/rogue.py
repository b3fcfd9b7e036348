"""Rogue nodes on the shipped family: accuracy with liars present, with verification off and on; how many
requests and seconds until each liar is quarantined; what verification costs.

    python -m layerswarm.bench.rogue [--requests 40] [--only NAME] [--json docs/results/rogue.json]

Sixteen real gRPC nodes on loopback, in this process (members 0 and 1, every block; four more honest
replicas of member 0's blocks 0-3 in the "peers" scenarios, where replicas referee); in a rogue
scenario member 0's nodes for blocks 0-3 lie (harness/faults.py), or run genuine software on a forged
copy of member 0 (then the coordinator runs non-strict, or it would refuse them outright). The
coordinator is in process too, with the shipped defaults (shuffle policy, fp16 wire, verification
rate 0.05 after 2 probation hops). Each request classifies 8 test images.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings
from layerswarm.harness.faults import FaultSpec, FaultyNode, forge_model_dir
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.zoo import family_root, robust_members
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.training.data.datasets import load_dataset

from . import emit_report
from .machine import environment

log = logging.getLogger(__name__)
ROGUE_BLOCKS = range(4)
BATCH = 8
FORGE_SCALE = 2.0  # noise of twice each tensor's std on every block: at 0.5 accuracy does not move


@dataclass(frozen=True)
class Scenario:
    """Who lies and how, and how the coordinator verifies (one row of the report)."""

    name: str
    rogue: str | None = None  # harness/faults.py mode of member 0's nodes for ROGUE_BLOCKS; None: honest
    verify: float | None = 0.05  # the verification rate; None: off
    forged: bool = False  # the rogues run genuine software on forged weights instead
    after: int = 0  # honest replies before lying
    rate: float = 1.0  # then lie on this share of replies
    verify_on: str = "coordinator"
    colluders: int = 0  # extra replicas of each rogue block that lie the same way (a colluding majority)


async def scenario(members: list[Path], plan: Scenario, requests: int, forged: Path | None) -> dict[str, Any]:
    """verify_on "peers": member 0's blocks 0-3 get an honest replica each, which (with the liar
    itself) referees the others' hops instead of the coordinator; `colluders` more replicas of each
    lie exactly as the rogue does, so the liars outnumber the honest replica."""
    rogue = plan.rogue
    forged = forged if plan.forged else None
    spec = None if rogue is None or forged is not None else FaultSpec(mode=rogue, after=plan.after, rate=plan.rate)
    layout = _nodes(members, spec, forged, replicas=plan.verify_on == "peers" or plan.colluders > 0)
    if spec is not None:
        layout += _colluders(members[0], spec, plan.colluders)
    verify, verify_on = plan.verify, plan.verify_on
    nodes = [n for n, _ in layout]
    for n in nodes:
        await n.start()
    liars = {f"127.0.0.1:{n.port}" for n, liar in layout if liar}
    coord = Coordinator(
        CoordinatorSettings(
            model_dir=members[0],
            family_dirs=tuple(members[1:]),
            peers=tuple(f"127.0.0.1:{n.port}" for n in nodes),
            mdns=False,
            strict=False if forged is not None else None,
            verify_rate=verify,
            verify_on=verify_on,
            min_blocks=1,
        )
    )
    await coord.start()
    try:
        return await _drive(coord, liars, requests)
    finally:
        await coord.stop()
        for n in nodes:
            await n.stop()


def _nodes(
    members: list[Path], spec: FaultSpec | None, forged: Path | None, replicas: bool = False
) -> list[tuple[Node, bool]]:
    """(node, lies) for every block of members 0 and 1, and honest replicas of member 0's rogue blocks."""
    out: list[tuple[Node, bool]] = []
    if replicas:
        for block in ROGUE_BLOCKS:
            out.append((Node(_settings(members[0], block)), False))
    for m, model_dir in enumerate(members[:2]):
        for block in range(read_manifest(model_dir).config.depth):
            liar = m == 0 and block in ROGUE_BLOCKS and (spec is not None or forged is not None)
            settings = _settings(forged if liar and forged is not None else model_dir, block)
            out.append((FaultyNode(settings, spec) if liar and spec is not None else Node(settings), liar))
    return out


def _colluders(model_dir: Path, spec: FaultSpec, count: int) -> list[tuple[Node, bool]]:
    """`count` more replicas of member 0's rogue blocks, each lying as `spec` says: the same weights
    and the same deterministic lie, so they agree with the rogue and with each other."""
    return [(FaultyNode(_settings(model_dir, block), spec), True) for block in ROGUE_BLOCKS for _ in range(count)]


def _settings(model_dir: Path, block: int) -> NodeSettings:
    return NodeSettings(model_dir=model_dir, block=block, advertise=False, grace_s=0.1)


async def _drive(coord: Coordinator, liars: set[str], requests: int) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while len(coord.registry.routable_by_block()) < coord.config.depth and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    manifest = coord.manifest
    data = load_dataset(manifest.dataset["spec"], seed=int(manifest.dataset.get("data_seed", 0)))
    x, y = data.test_x, data.test_y
    caught_at: dict[str, int] = {}
    rows: list[tuple[int, bool, float]] = []  # (correct, all liars caught before it, ms)
    started = time.monotonic()
    for i in range(requests):
        lo = (i * BATCH) % (len(x) - BATCH)
        all_caught = len(caught_at) == len(liars)
        result = await coord.router.classify(x[lo : lo + BATCH], ClassifyOptions(seed=i))
        correct = int((result.probs.argmax(-1) == y[lo : lo + BATCH]).sum())
        rows.append((correct, all_caught, result.elapsed_ms))
        for address in liars - set(caught_at):
            if not coord.registry.nodes[address].routable:
                caught_at[address] = i + 1
    return _summary(coord, rows, liars, caught_at, time.monotonic() - started)


def _summary(
    coord: Coordinator, rows: list[tuple[int, bool, float]], liars: set[str], caught: dict[str, int], seconds: float
) -> dict[str, Any]:
    def acc(subset: list[tuple[int, bool, float]]) -> float | None:
        return round(sum(c for c, _, _ in subset) / (BATCH * len(subset)), 4) if subset else None

    stats = coord.verifier.stats() if coord.verifier else None
    total_ms = sum(ms for _, _, ms in rows)
    out: dict[str, Any] = {
        "requests": len(rows),
        "images": BATCH * len(rows),
        "accuracy": acc(rows),
        "accuracy_before_all_detected": acc([r for r in rows if not r[1]]),
        "accuracy_after_all_detected": acc([r for r in rows if r[1]]),
        "rogues": len(liars),
        "rogues_detected": len(caught),
        "requests_to_detect": sorted(caught.values()),
        "mean_request_ms": round(total_ms / len(rows), 2),
        "seconds": round(seconds, 2),
    }
    if stats is not None:
        detections = [d for d in stats["detections"] if d["address"] in liars]
        out["seconds_to_detect"] = sorted(d["seconds_since_first_hop"] for d in detections)
        out["hops_to_detect"] = sorted(d["hops_before_detection"] for d in detections)
        out["checks_that_caught"] = sorted({d["check"] for d in detections})
        out["false_quarantines"] = sum(
            1 for r in coord.registry.nodes.values() if r.address not in liars and r.convicted
        )
        out["reexecuted_hops_per_request"] = round(stats["hops_reexecuted"] / len(rows), 3)
        out["reexecute_ms_per_request"] = round(stats["reexecute_ms_total"] / len(rows), 3)
        out["reexecute_share_of_request_time"] = round(stats["reexecute_ms_total"] / total_ms, 4)
        out["peer_reexecuted_hops_per_request"] = round(stats["hops_reexecuted_on_peers"] / len(rows), 3)
        out["peer_calls_per_request"] = round(stats["peer_calls"] / len(rows), 3)
        out["unresolved_disagreements"] = stats["unresolved_disagreements"]
    return out


async def run(requests: int, only: str | None = None) -> dict[str, Any]:
    members = robust_members(family_root())
    report: dict[str, Any] = {"environment": environment(), "requests_per_scenario": requests, "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        forged = forge_model_dir(members[0], Path(tmp) / "forged", scale=FORGE_SCALE)
        plan = [
            Scenario("honest, verification off", verify=None),
            Scenario("honest, verification on"),
            Scenario("honest, replicas, verification on peers", verify_on="peers"),
            Scenario("noise, replicas, verification on peers", "noise", verify_on="peers"),
            Scenario(
                "noise after 2 honest hops, replicas, verification on peers", "noise", 0.25, after=2, verify_on="peers"
            ),
        ]  # fmt: skip
        for mode in ("zeros", "noise", "other-block", "forged"):
            rogue = "forged" if mode == "forged" else mode
            plan.append(Scenario(f"{mode}, verification off", rogue, None, forged=mode == "forged"))
            plan.append(Scenario(f"{mode}, verification on", rogue, forged=mode == "forged"))
        plan.append(Scenario("noise after 2 honest hops (past probation), verification on", "noise", after=2))
        plan.append(
            Scenario("noise after 2 honest hops (past probation), verification rate 0.25", "noise", 0.25, after=2)
        )
        # Issue 45: liars that pass probation and then lie cleverly or rarely, and colluding majorities,
        # against the adaptive rule (default rate).
        plan.append(Scenario("issue45: honest, verification on"))
        for mode in ("push", "other-block"):
            plan.append(Scenario(f"issue45: {mode} after 10 honest hops, verification on", mode, after=10))
        plan.append(
            Scenario("issue45: noise on 5% of hops after 10 honest, verification on", "noise", after=10, rate=0.05)
        )
        for where in ("coordinator", "peers", "auto"):
            plan.append(
                Scenario(
                    f"issue45: colluding majority (3 same lies, 1 honest replica), verification on {where}",
                    "other-block", verify_on=where, colluders=2,
                )
            )  # fmt: skip
        for item in plan:
            if only is not None and only not in item.name:
                continue
            log.info("scenario: %s", item.name)
            report["scenarios"][item.name] = await scenario(members, item, requests, forged)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerswarm.bench.rogue", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=40, help="requests per scenario (8 images each)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--only", help="run only the scenarios whose name contains this (e.g. honest)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    return emit_report(asyncio.run(run(args.requests, args.only)), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
