"""Generation through two checkouts' swarms in one run: before and after a change, interleaved.

    git archive BASE_COMMIT src | tar -x -C /tmp/base
    python -m layerswarm.bench.generation_ab /tmp/base/src [ROUNDS] [--json OUT]

Two swarms of the shipped decoder (bench/generation.py's: a node process per block and a coordinator,
fp32 wire) run side by side, one on the code under BASE_SRC (PYTHONPATH) and one on this checkout's.
Each round measures both, alternating which goes first, so a busy machine slows both alike: batch-1
ms per token (the median gap between streamed tokens), the whole swarm's CPU milliseconds per token
(nodes and coordinator, from /proc: steadier than wall time on a loaded machine), and 1 against 16
concurrent streams' tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse

import layerswarm
from layerswarm.harness.procs import Proc, coordinator_cmd, launch, node_cmd, spawn, stop_all, wait_for_ready_line
from layerswarm.harness.swarm import wait_for_swarm
from layerswarm.models.checkpoint import read_lm_manifest
from layerswarm.models.zoo import family_root

from .fixtures import cpu_seconds
from .generation import CONCURRENT, MEMBER, PROMPT, TOKENS, tokens_per_s

HERE_SRC = Path(layerswarm.__file__).resolve().parents[1]


def _swarm(src: Path) -> tuple[list[Proc], Proc]:
    member, env = family_root("lm") / MEMBER, {"PYTHONPATH": str(src)}
    depth = read_lm_manifest(member).config.depth
    procs = [launch(f"ab-node-{b}", node_cmd(member, b, "--no-advertise", "--grace", "0.2"), env) for b in range(depth)]
    try:
        procs = [wait_for_ready_line(p, 180) for p in procs]
        return procs, spawn("ab-coordinator", coordinator_cmd(member, procs, "--wire-dtype", "fp32"), 120, env)
    except Exception:
        stop_all(procs)
        raise


def _batch1(http: httpx.Client, procs: list[Proc]) -> tuple[list[float], float]:
    """One streamed answer's gaps between tokens, and the swarm's CPU seconds per token over it."""
    stamps: list[float] = []
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    before = sum(cpu_seconds(p.popen.pid) for p in procs)
    with connect_sse(http, "POST", "/v1/generate", json=body) as source:
        source.response.raise_for_status()
        for event in source.iter_sse():
            if event.event == "token":
                stamps.append(time.perf_counter())
    cpu = sum(cpu_seconds(p.popen.pid) for p in procs) - before
    return [b - a for a, b in itertools.pairwise(stamps)], cpu / max(len(stamps), 1)


def run(base_src: Path, rounds: int) -> dict[str, Any]:
    sides = {"base": base_src.resolve(), "this": HERE_SRC}
    load = [round(os.getloadavg()[0], 2)]
    swarms: dict[str, tuple[list[Proc], Proc]] = {}
    seen: dict[str, dict[str, list[float]]] = {k: {"gaps": [], "cpu": [], "one": [], "many": []} for k in sides}
    try:
        for side, src in sides.items():
            swarms[side] = _swarm(src)
        for r in range(rounds):
            for side in list(sides)[:: 1 if r % 2 == 0 else -1]:
                procs, coordinator = swarms[side]
                base = f"http://127.0.0.1:{coordinator.ready['port']}"
                with httpx.Client(base_url=base, timeout=60.0) as http:
                    wait_for_swarm(http, len(procs), 120)
                    gaps, cpu = _batch1(http, [*procs, coordinator])
                seen[side]["gaps"] += gaps
                seen[side]["cpu"].append(cpu)
                seen[side]["one"].append(asyncio.run(tokens_per_s(base, 1)).tokens_per_s)
                seen[side]["many"].append(asyncio.run(tokens_per_s(base, CONCURRENT)).tokens_per_s)
    finally:
        for procs, coordinator in swarms.values():
            stop_all([coordinator, *procs])
    load.append(round(os.getloadavg()[0], 2))
    report: dict[str, Any] = {"rounds": rounds, "load_average": load, "sources": {k: str(v) for k, v in sides.items()}}
    for side, s in seen.items():
        one, many = statistics.median(s["one"]), statistics.median(s["many"])
        report[side] = {
            "batch1_ms_per_token": round(statistics.median(s["gaps"]) * 1e3, 3),
            "swarm_cpu_ms_per_token": round(statistics.median(s["cpu"]) * 1e3, 2),
            "tokens_per_s_1_stream": round(one, 1),
            f"tokens_per_s_{CONCURRENT}_streams": round(many, 1),
            f"streams_{CONCURRENT}_over_1": round(many / one, 2),
        }
    report["this_over_base_batch1"] = round(
        report["this"]["batch1_ms_per_token"] / report["base"]["batch1_ms_per_token"], 3
    )
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerswarm.bench.generation_ab", description=__doc__.split("\n")[0])
    p.add_argument("base_src", type=Path, help="the `src` directory of the checkout to compare against")
    p.add_argument("rounds", type=int, nargs="?", default=6, help="interleaved rounds (default 6)")
    p.add_argument("--json", type=Path, help="write the report here too")
    args = p.parse_args(argv)
    if not (args.base_src / "layerswarm" / "__init__.py").is_file():
        p.error(f"base_src: {args.base_src} holds no layerswarm package (give a checkout's src directory)")
    report = run(args.base_src, args.rounds)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
