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
import json
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .swarm_demo import UpOptions, choose_victims, progress, start_swarm

STREAMS = 12  # concurrent streams per phase
MAX_TOKENS = 16  # a task answer is a few tokens and </s>: room to spare, so a wrong answer is seen whole


@dataclass
class StreamResult:
    done: bool = False  # its events ended with [DONE]
    error: str | None = None
    text: str = ""
    correct: bool = False
    chunks: int = 0
    in_flight_at_kill: bool = False
    rebuilt: int = 0
    skipped: int = 0
    elapsed_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    trips: int = 0


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


@dataclass
class Task:
    prompt_ids: list[int]
    answer: str


def task_prompts(member: Path, count: int, seed: int) -> list[Task]:
    """Held-out generated task prompts (drawn with a seed apart from the training data's) and their answers."""
    from layerswarm.models.checkpoint import read_lm_manifest
    from layerswarm.training.lm.commands import model_tokenizer
    from layerswarm.training.lm.data import prompt_ids
    from layerswarm.training.lm.tasks import make_examples

    manifest = read_lm_manifest(member)
    tok = model_tokenizer(member, manifest)
    _, examples = make_examples(0, count, seed=12345 + seed)
    return [Task(prompt_ids(tok, manifest.config, e), e.answer) for e in examples]


async def stream_one(
    client: Any, model: str, task: Task, result: StreamResult, first: asyncio.Event, speculation: str = "off"
) -> None:
    """One completion, read event by event until [DONE] (or an error event, or the connection's end)."""
    import httpx
    from httpx_sse import SSEError, aconnect_sse

    body = {"model": model, "prompt": task.prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    body["speculation"] = int(speculation) if speculation.isdigit() else speculation
    started = time.monotonic()
    try:
        async with aconnect_sse(client, "POST", "/v1/completions", json=body) as source:
            if source.response.status_code != 200:
                result.error = f"HTTP {source.response.status_code}: {(await source.response.aread())[:200]!r}"
                return
            async for event in source.aiter_sse():
                if event.data == "[DONE]":
                    result.done = True
                    break
                chunk = json.loads(event.data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    break
                result.chunks += 1
                first.set()
                for choice in chunk.get("choices", []):
                    result.text += choice.get("text") or ""
                extras = chunk.get("layerswarm")
                if extras:
                    result.rebuilt, result.skipped = int(extras["rebuilt"]), int(extras["skipped"])
                    spec = extras.get("speculation") or {}
                    result.drafted, result.accepted = int(spec.get("drafted", 0)), int(spec.get("accepted", 0))
                    result.trips = int(extras.get("trips", 0))
    except (httpx.HTTPError, SSEError, ValueError) as exc:  # this stream's outcome, reported in the summary
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.elapsed_s = round(time.monotonic() - started, 3)
        result.correct = result.done and result.text.strip() == task.answer


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


def failover_counts(metrics: str) -> dict[str, float]:
    """The coordinator's own failover counters (layerswarm_gen_failovers_total{kind=...})."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name == "layerswarm_gen_failovers":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels.get("kind", "")] = sample.value
    return counts


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
