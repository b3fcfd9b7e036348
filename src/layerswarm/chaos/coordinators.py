"""Several coordinators in a chaos run (`layerswarm chaos --coordinators N`): clients that fail over,
every coordinator SIGKILLed and restarted in turn, and a liar convicted by one avoided by the others.

- Load: the Python client (layerswarm.client.AsyncSwarmClient) with every coordinator's URL, one client
  per concurrent worker (a client's failover position is its own), `attempts=1`: a call tries each
  coordinator at most once, so no request is ever sent twice to one URL; every URL a request went to is
  recorded (`Record.tried`). A request starts at the next coordinator in turn (load spread over all).
- Kills: after the baseline, each coordinator in turn is SIGKILLed (in-flight requests cut, no shutdown)
  and started again; the next is killed only once the restarted one's /readyz says ready. Never two down.
- Liars: each coordinator's /v1/nodes is polled; for each rogue, the first coordinator to show it
  quarantined convicted it first; every other coordinator's answers sent after that moment whose trace
  went through the rogue are counted (target: at most 5). Tips acted on are read from each
  coordinator's log.
- A balancer (balancer.py: HAProxy, where installed): `balanced_workers` of the workers send to its one
  URL instead, with one attempt (no client retry at all): what curl or an OpenAI client would see.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from layerswarm.client import AsyncSwarmClient, SwarmError

from .balancer import Balancer
from .balancer import start as start_balancer
from .balancer import unavailable as balancer_unavailable
from .load import Record, bounded_indices
from .swarm import ChaosSwarm

log = logging.getLogger(__name__)
AVOID_WITHIN = 5  # requests a coordinator may route through a liar after another convicted it
TIP_MARK = "its next"  # the coordinator's log line for a tip it acted on (process.py: take_tip)
_TRIED: contextvars.ContextVar[list[str]] = contextvars.ContextVar("tried")


async def run_failover_load(
    urls: Sequence[str],
    samples: Sequence[tuple[bytes, str]],
    requests: int,
    concurrency: int,
    deadline_s: float,
    until: asyncio.Event | None = None,
    max_s: float = 600.0,
    records: list[Record] | None = None,
    balancer: str | None = None,
    balanced_workers: int = 0,
) -> list[Record]:
    """As load.run_load, through the client with every coordinator: at least `requests`, on until
    `until` is set, never longer than `max_s`. A request is lost when every coordinator failed it.
    With a `balancer` URL, the first `balanced_workers` workers send there only."""
    records = [] if records is None else records
    queue = bounded_indices(requests, until, max_s)

    async def worker(targets: Sequence[str]) -> None:
        async with _client(targets, deadline_s) as client:
            for i in queue:
                image, label = samples[i % len(samples)]
                records.append(await one_request(client, i, image, label))

    shares = [[balancer] if balancer and w < balanced_workers else urls for w in range(concurrency)]
    await asyncio.gather(*(worker(targets) for targets in shares))
    return sorted(records, key=lambda r: r.index)


def _client(urls: Sequence[str], deadline_s: float) -> AsyncSwarmClient:
    async def note(request: httpx.Request) -> None:
        _TRIED.get().append(f"{request.url.scheme}://{request.url.host}:{request.url.port}")

    http = httpx.AsyncClient(
        timeout=deadline_s + 5,
        limits=httpx.Limits(max_keepalive_connections=0),  # a fresh connection each, as load.run_load
        event_hooks={"request": [note]},
    )
    # attempts counts per coordinator: 1 means each coordinator once per call, never the same one twice.
    return AsyncSwarmClient(list(urls), attempts=1, timeout=deadline_s + 5, http=http)


async def one_request(client: AsyncSwarmClient, index: int, image: bytes, label: str) -> Record:
    tried: list[str] = []
    _TRIED.set(tried)
    client.failover.index = index % len(client.failover.urls)  # start at the next coordinator in turn
    started = time.monotonic()
    try:
        answer = await client.classify(image, seed=index)
    except SwarmError as exc:
        return Record(index, started, time.monotonic() - started, exc.status, exc.error, tried=tried)
    except httpx.HTTPError as exc:  # every coordinator failed it: no answer
        return Record(index, started, time.monotonic() - started, None, f"{type(exc).__name__}: {exc}", tried=tried)
    hops: dict[str, int] = {}
    for hop in answer.trace.hops:
        hops[hop.outcome] = hops.get(hop.outcome, 0) + 1
    return Record(
        index,
        started,
        time.monotonic() - started,
        200,
        correct=answer.prediction == label,
        depth=answer.depth,
        hops=hops,
        nodes=[h.node for h in answer.trace.hops if h.node],
        tried=tried,
    )


async def kill_each_in_turn(
    swarm: ChaosSwarm,
    start: asyncio.Event,
    done: asyncio.Event,
    gap_s: float,
    kills: list[dict[str, Any]],
    tips: TipTally,
) -> None:
    """After `start`: every coordinator SIGKILLed and restarted, one at a time, `gap_s` apart; the next
    only once the restarted one is ready (/readyz 200). Each kill's timings go to `kills`."""
    await start.wait()
    for index, url in enumerate(swarm.urls):
        if done.is_set():
            return
        await _sleep_or_done(done, gap_s)
        old = swarm.coordinator_proc(index)
        kill: dict[str, Any] = {"coordinator": index + 1, "url": url, "killed_pid": old.pid if old else None}
        kills.append(kill)
        log.info("SIGKILL coordinator %d (%s)", index + 1, url)
        tips.drain(index)
        kill["killed_at"] = time.monotonic()
        await asyncio.to_thread(swarm.kill_coordinator, index)
        new = await asyncio.to_thread(swarm.start_coordinator_at, index)
        kill["serving_at"] = time.monotonic()  # its ready line: HTTP answers
        kill["restarted_pid"] = new.pid
        kill["ready_at"] = await _wait_ready(url, done)  # /readyz 200: the minimum depth is reachable
        kill["outage_s"] = round(kill["serving_at"] - kill["killed_at"], 3)
        kill["until_ready_s"] = None if kill["ready_at"] is None else round(kill["ready_at"] - kill["killed_at"], 3)


async def _wait_ready(url: str, done: asyncio.Event, timeout: float = 60.0) -> float | None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=2) as http:
        while time.monotonic() < deadline:
            try:
                if (await http.get("/readyz")).status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass  # starting: not listening yet
            await asyncio.sleep(0.1)
    return None


async def _sleep_or_done(done: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(done.wait(), seconds)
    except asyncio.TimeoutError:
        return


@dataclass
class CoordinatorRun:
    """What a run with several coordinators keeps besides the load: kills, tips, the balancer."""

    swarm: ChaosSwarm
    kills: list[dict[str, Any]] = field(default_factory=list)
    balancer: Balancer | None = None
    balancer_note: str | None = None  # why there is none
    balanced_workers: int = 0  # workers that send through it

    def __post_init__(self) -> None:
        self.tips = TipTally(self.swarm)

    def start_balancer(self) -> str | None:
        self.balancer_note = balancer_unavailable()
        if self.balancer_note is None:
            self.balancer = start_balancer(self.swarm.urls)
        return None if self.balancer is None else self.balancer.url

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.stop()


class TipTally:
    """Tips each coordinator acted on, every incarnation together: read from the lines its process
    printed after its ready line (drained before an incarnation is replaced, and at the end)."""

    def __init__(self, swarm: ChaosSwarm) -> None:
        self.swarm = swarm
        self.counts = [0] * len(swarm.urls)

    def drain(self, index: int) -> None:
        proc = self.swarm.coordinator_proc(index)
        while proc is not None:
            try:
                line = proc.lines.get_nowait()
            except queue.Empty:  # nothing more printed yet
                return
            if line is not None and TIP_MARK in line and "re-executed" in line:
                self.counts[index] += 1

    def by_url(self) -> dict[str, int]:
        for index in range(len(self.counts)):
            self.drain(index)
        return dict(zip(self.swarm.urls, self.counts, strict=True))


def liar_avoidance(
    rogues: list[dict[str, Any]], timelines: dict[str, list[tuple[float, dict[str, str]]]], records: list[Record]
) -> list[dict[str, Any]]:
    """Per rogue: which coordinator convicted it first and when; per other coordinator, its answers sent
    after that whose path went through the rogue, and when it showed the rogue quarantined itself."""
    out = []
    for rogue in rogues:
        address, start = rogue["address"], rogue["lying_from"]
        seen = {url: _first_quarantined(timeline, address, start) for url, timeline in timelines.items()}
        convicted = {u: t for u, t in seen.items() if t is not None}
        if not convicted:
            out.append({"target": rogue["target"], "mode": rogue["mode"], "first": None, "others": {}})
            continue
        first_url = min(convicted, key=lambda u: convicted[u])
        first = convicted[first_url]
        # Before the first conviction, through any coordinator: shows that the count below can see it.
        before = sum(address in r.nodes for r in records if r.status == 200 and start <= r.sent < first)
        others = {}
        for url in timelines:
            if url == first_url:
                continue
            served = [r for r in records if r.status == 200 and r.tried and r.tried[-1] == url and r.sent >= first]
            own = seen[url]
            others[url] = {
                "requests_through_liar": sum(address in r.nodes for r in served),
                "answers_after_first_conviction": len(served),
                "showed_quarantined_after_s": None if own is None else round(own - first, 3),
            }
        out.append(
            {
                "target": rogue["target"],
                "mode": rogue["mode"],
                "address": address,
                "first": first_url,
                "first_after_lying_s": round(first - start, 3),
                "requests_through_liar_before_first_conviction": before,
                "others": others,
            }
        )
    return out


def _first_quarantined(timeline: list[tuple[float, dict[str, str]]], address: str, after: float) -> float | None:
    return next((t for t, states in timeline if t >= after and states.get(address) == "quarantined"), None)


def client_figures(records: list[Record], urls: Sequence[str], balancer: str | None = None) -> dict[str, Any]:
    """What the clients saw: failovers, retries to one URL (0 by construction, counted anyway), 5xx;
    the balancer's share apart as well."""
    repeats = sum(len(r.tried) - len(set(r.tried)) for r in records)
    balanced = [r for r in records if balancer is not None and r.tried == [balancer]]
    return {
        "through_balancer": {
            "sent": len(balanced),
            "ok": sum(r.status == 200 for r in balanced),
            "http_5xx": sum(r.status is not None and r.status >= 500 for r in balanced),
            "no_answer": sum(r.status is None for r in balanced),
        },
        "attempts_per_coordinator_per_request": 1,
        "same_coordinator_retries": repeats,
        "requests_failed_over": sum(len(r.tried) > 1 for r in records),
        "extra_attempts": sum(max(0, len(r.tried) - 1) for r in records),
        "http_5xx": sum(r.status is not None and r.status >= 500 for r in records),
        "no_answer": sum(r.status is None for r in records),
        "served_by": {u: sum(1 for r in records if r.status == 200 and r.tried[-1:] == [u]) for u in urls},
    }


def coordinator_checks(section: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue-43 targets as check rows (checks.py's shape)."""
    clients, kills, liars = section["clients"], section["kills"], section["liars"]
    count = len(section["urls"])
    worst = max((o["requests_through_liar"] for liar in liars for o in liar["others"].values()), default=None)
    rows = [
        {
            "target": f"every coordinator ({count}) SIGKILLed and restarted in turn, ready again",
            "measured": f"{sum(k.get('ready_at_s') is not None for k in kills)} of {count} back ready",
            "pass": len(kills) == count and all(k.get("ready_at_s") is not None for k in kills),
        },
        {
            "target": "0 5xx and 0 unanswered seen by clients, no retry to the same coordinator",
            "measured": f"{clients['http_5xx']} 5xx, {clients['no_answer']} unanswered, "
            f"{clients['same_coordinator_retries']} same-coordinator retries "
            f"({clients['requests_failed_over']} requests failed over)",
            "pass": clients["http_5xx"] == 0 and clients["no_answer"] == 0 and clients["same_coordinator_retries"] == 0,
        },
        {
            "target": f"a liar convicted by one coordinator: others route through it at most {AVOID_WITHIN} times",
            "measured": "no liar convicted" if worst is None else f"at most {worst} requests ({len(liars)} liars)",
            "pass": worst is not None and worst <= AVOID_WITHIN and all(liar["first"] for liar in liars),
        },
    ]
    return rows


def relative_times(section: dict[str, Any], t0: float) -> None:
    """The kills' monotonic instants as seconds since the run's first request."""
    for kill in section["kills"]:
        for key in ("killed_at", "serving_at", "ready_at"):
            at = kill.pop(key, None)
            kill[f"{key}_s"] = None if at is None else round(at - t0, 3)


def render_coordinators(section: dict[str, Any]) -> list[str]:
    clients = section["clients"]
    lines = [
        f"coordinators: {len(section['urls'])}; answers by coordinator {clients['served_by']}; "
        f"{clients['requests_failed_over']} requests failed over, {clients['same_coordinator_retries']} retries "
        f"to the same coordinator (1 attempt per coordinator); tips acted on {section['tips_acted']}",
        _balancer_line(section["balancer"], clients["through_balancer"]),
        "",
        "| coordinator killed | SIGKILL at (s) | serving again after (s) | ready after (s) |",
        "| --- | --- | --- | --- |",
    ]
    for k in section["kills"]:
        url, at, ready = k["url"], k["killed_at_s"], k["until_ready_s"]
        lines.append(f"| {k['coordinator']} ({url}) | {at} | {k.get('outage_s')} | {ready} |")
    lines += ["", "| liar | first convicted by | other coordinator | requests through it after |"]
    lines.append("| --- | --- | --- | --- |")
    for liar in section["liars"]:
        for url, other in liar["others"].items():
            name = f"{liar['mode']} {liar['target']}"
            lines.append(f"| {name} | {liar['first']} | {url} | {other['requests_through_liar']} |")
    return lines


def _balancer_line(balancer: dict[str, Any], figures: dict[str, int]) -> str:
    if balancer["url"] is None:
        return f"no HAProxy: {balancer['not_started']}"
    return f"through HAProxy ({balancer['workers']} workers, one attempt each, no client retry): {figures}"
