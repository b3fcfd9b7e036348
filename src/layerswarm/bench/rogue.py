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


async def scenario(
    members: list[Path],
    rogue: str | None,
    verify: float | None,
    requests: int,
    forged: Path | None,
    after: int = 0,
    verify_on: str = "coordinator",
) -> dict[str, Any]:
    """verify_on "peers": member 0's blocks 0-3 get an honest replica each, which (with the liar
    itself) referees the others' hops instead of the coordinator."""
    layout = _nodes(members, rogue, forged, after, replicas=verify_on == "peers")
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
    members: list[Path], rogue: str | None, forged: Path | None, after: int, replicas: bool = False
) -> list[tuple[Node, bool]]:
    """(node, lies) for every block of members 0 and 1, and honest replicas of member 0's rogue blocks."""
    out: list[tuple[Node, bool]] = []
    if replicas:
        for block in ROGUE_BLOCKS:
            out.append((Node(NodeSettings(model_dir=members[0], block=block, advertise=False, grace_s=0.1)), False))
    for m, model_dir in enumerate(members[:2]):
        for block in range(read_manifest(model_dir).config.depth):
            liar = m == 0 and block in ROGUE_BLOCKS and rogue is not None
            settings = NodeSettings(
                model_dir=forged if liar and forged is not None else model_dir,
                block=block,
                advertise=False,
                grace_s=0.1,
            )
            if liar and forged is None:
                assert rogue is not None
                out.append((FaultyNode(settings, FaultSpec(mode=rogue, after=after)), True))
            else:
                out.append((Node(settings), liar))
    return out


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
        plan: list[tuple[str, str | None, float | None, Path | None, int, str]] = [
            ("honest, verification off", None, None, None, 0, "coordinator"),
            ("honest, verification on", None, 0.05, None, 0, "coordinator"),
            ("honest, replicas, verification on peers", None, 0.05, None, 0, "peers"),
            ("noise, replicas, verification on peers", "noise", 0.05, None, 0, "peers"),
            ("noise after 2 honest hops, replicas, verification on peers", "noise", 0.25, None, 2, "peers"),
        ]
        for mode in ("zeros", "noise", "other-block", "forged"):
            f = forged if mode == "forged" else None
            plan.append((f"{mode}, verification off", mode, None, f, 0, "coordinator"))
            plan.append((f"{mode}, verification on", mode, 0.05, f, 0, "coordinator"))
        plan.append(
            ("noise after 2 honest hops (past probation), verification on", "noise", 0.05, None, 2, "coordinator")
        )
        plan.append(
            (
                "noise after 2 honest hops (past probation), verification rate 0.25",
                "noise",
                0.25,
                None,
                2,
                "coordinator",
            )
        )
        # Issue 45: liars that pass probation and then lie cleverly, against the adaptive rule (default rate).
        plan.append(("issue45: honest, verification on", None, 0.05, None, 0, "coordinator"))
        for mode in ("push", "other-block"):
            plan.append((f"issue45: {mode} after 10 honest hops, verification on", mode, 0.05, None, 10, "coordinator"))
        for name, kind, verify, f, after, where in plan:
            if only is not None and only not in name:
                continue
            log.info("scenario: %s", name)
            report["scenarios"][name] = await scenario(members, kind, verify, requests, f, after, where)
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
