"""`layerswarm up --family lm`: the generative family end to end, and what a node's death mid-stream costs.

Same swarm as the classifier demo (cli/up.py: a node per block of two shuffle-robust members, a coordinator),
then two phases of concurrent completions over the OpenAI-compatible API (`POST /v1/completions`, `stream:
true`, greedy), each a held-out generated task prompt whose answer is checked exactly:

    all nodes up      --streams streams at once, nothing killed
    N nodes killed    --streams streams at once; once half of them have their first token, N nodes are
                      SIGKILLed (every node of one block index, whose block is then skipped, and others
                      whose block is rebuilt on a node of a sibling model), and the streams go on

A stream "finished" when its server-sent events end with `data: [DONE]`; the summary counts them, the
streams still in flight when the kill landed, and the rebuilt and skipped hops from each stream's own
trace (the `layerswarm` object of its last chunk). With --speculation, every stream asks for it (the
coordinator drafts, the route verifies: docs/speculation.md) and the summary adds its drafts and trips.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .swarm_demo import UpOptions, choose_victims, progress, start_swarm

if TYPE_CHECKING:  # at run time imported where used: `--help` must work on the torch-free node install
    from layerswarm.harness.streams import StreamResult, Task

STREAMS = 12  # concurrent streams per phase


@dataclass
class StreamPhase:
    name: str
    streams: list[StreamResult] = field(default_factory=list)

    def tally(self) -> dict[str, Any]:
        n = len(self.streams)
        done = [s for s in self.streams if s.done]
        return {
            "streams": n,
            "done": len(done),
            "failed": n - len(done),
            "exact_match": round(sum(s.correct for s in self.streams) / n, 4) if n else 0.0,
            "in_flight_at_kill": sum(s.in_flight_at_kill for s in self.streams),
            "rebuilt_hops": sum(s.rebuilt for s in self.streams),
            "skipped_hops": sum(s.skipped for s in self.streams),
            "streams_with_failover": sum(bool(s.rebuilt or s.skipped) for s in self.streams),
            "drafted": sum(s.drafted for s in self.streams),
            "accepted": sum(s.accepted for s in self.streams),
            "trips": sum(s.trips for s in self.streams),
        }


async def run_phase(
    base: str,
    model: str,
    phase: StreamPhase,
    tasks: list[Task],
    kill: list[Any] | None = None,
    speculation: str = "off",
) -> None:
    """Every task as one stream, all at once; with `kill`, those processes are SIGKILLed as soon as half
    of the streams have their first token."""
    import httpx

    from layerswarm.harness.streams import StreamResult, stream_one

    progress(f"{phase.name}: {len(tasks)} concurrent streams (POST /v1/completions, stream: true)...")
    phase.streams = [StreamResult() for _ in tasks]
    firsts = [asyncio.Event() for _ in tasks]
    timeout = httpx.Timeout(120.0, connect=10.0)
    limits = httpx.Limits(max_connections=len(tasks) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as client:
        runs = [
            asyncio.create_task(stream_one(client, model, t, r, f, speculation))
            for t, r, f in zip(tasks, phase.streams, firsts, strict=True)
        ]
        if kill:
            while sum(f.is_set() for f in firsts) < (len(tasks) + 1) // 2 and not all(r.done() for r in runs):
                await asyncio.sleep(0.005)
            for result, run in zip(phase.streams, runs, strict=True):
                result.in_flight_at_kill = not run.done()
            for proc in kill:
                proc.signal(signal.SIGKILL)
            progress(
                f"{phase.name}: SIGKILLed {len(kill)} nodes with {sum(not r.done() for r in runs)} streams in flight"
            )
        await asyncio.gather(*runs)


def run_up_lm(opts: UpOptions, streams: int, speculation: str = "off") -> dict[str, Any]:
    import httpx

    from layerswarm.harness.procs import stop_all
    from layerswarm.harness.streams import failover_counts, task_prompts
    from layerswarm.harness.swarm import wait_for_swarm

    rng = random.Random(opts.seed)
    nodes, coordinator, members = start_swarm(dataclasses.replace(opts, concurrent=streams))
    try:
        tasks = task_prompts(members[0], streams, opts.seed)
        base = f"http://127.0.0.1:{coordinator.ready['port']}"
        with httpx.Client(base_url=base, timeout=30.0) as client:
            progress(f"coordinator on {base}; waiting until all {len(nodes)} nodes are healthy...")
            wait_for_swarm(client, len(nodes), opts.timeout_s)
            model = client.get("/v1/models").json()["data"][0]["id"]
        asked = opts.kill if opts.kill is not None else len(nodes) // 3
        killed = choose_victims(nodes, asked, rng, opts.victims)
        if len(killed) < asked:
            progress(f"--kill {asked}: only {len(killed)} can go (every block index but one keeps a node)")
        # the same prompts in both phases (greedy): what the kills cost is the difference, not the prompts'
        before = StreamPhase("all nodes up")
        asyncio.run(run_phase(base, model, before, tasks[:streams], speculation=speculation))
        after = StreamPhase(f"{len(killed)} nodes killed")
        asyncio.run(run_phase(base, model, after, tasks[:streams], killed, speculation))
        with httpx.Client(base_url=base, timeout=30.0) as client:
            view = client.get("/v1/nodes").json()
            metrics = client.get("/metrics").text
        return {**summarise([before, after], nodes, killed, view, failover_counts(metrics)), "speculation": speculation}
    finally:
        progress("stopping the swarm...")
        stop_all([coordinator, *nodes])


def summarise(
    phases: list[StreamPhase], nodes: list[Any], killed: list[Any], view: dict[str, Any], failovers: dict[str, float]
) -> dict[str, Any]:
    total = StreamPhase("total", [s for p in phases for s in p.streams]).tally()
    errors = [s.error for p in phases for s in p.streams if s.error]
    return {
        **total,
        "nodes_started": len(nodes),
        "nodes_killed": len(killed),
        "killed": [{"pid": p.pid, "block": p.ready["block"], "model_id": p.ready["model_id"]} for p in killed],
        "phases": {p.name: p.tally() for p in phases},
        "coordinator_failovers": failovers,
        "errors": errors[:5],
        "swarm_after": {"reachable_depth": view.get("reachable_depth"), "depth": view.get("depth")},
    }


def render(summary: dict[str, Any]) -> str:
    lines = [
        f"layerswarm up --family lm: {summary['nodes_started']} nodes started, {summary['nodes_killed']} killed "
        "(SIGKILL) mid-stream",
        "",
        f"{'phase':<20}{'streams':>8}{'[DONE]':>8}{'failed':>8}{'exact':>7}{'in flight':>11}{'rebuilt':>9}"
        f"{'skipped':>9}",
    ]
    rows = [*summary["phases"].items(), ("total", summary)]
    for name, t in rows:
        lines.append(
            f"{name:<20}{t['streams']:>8}{t['done']:>8}{t['failed']:>8}{t['exact_match']:>7.3f}"
            f"{t['in_flight_at_kill']:>11}{t['rebuilt_hops']:>9}{t['skipped_hops']:>9}"
        )
    lines += [
        "",
        "in flight: streams mid-way when the nodes were killed; rebuilt/skipped: hops, from each stream's trace",
    ]
    lines.append(f"coordinator's failover counters: {summary['coordinator_failovers']}")
    if summary.get("speculation", "off") != "off":
        kept = summary["accepted"] / summary["drafted"] if summary["drafted"] else 0.0
        lines.append(
            f"speculation {summary['speculation']}: {summary['accepted']} of {summary['drafted']} drafts kept "
            f"({kept:.0%}), {summary['trips']} trips for the streams' tokens and end tokens"
        )
    lines.append(f"swarm after: {summary['swarm_after']}")
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)
