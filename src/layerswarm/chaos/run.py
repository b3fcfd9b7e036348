"""`layerswarm chaos`: load and a seeded schedule of faults against a swarm of one-host-per-node, then
the report. One fault at a time, on one node (one block index keeps its other model's node), so the
swarm's minimum depth stays reachable and every request should be answered 200."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from layerswarm.harness.samples import labelled_samples, task_data
from layerswarm.harness.swarm import swarm_is_up
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.zoo import family_root, robust_members

from . import swarm as chaos_swarm
from .load import run_load
from .options import ChaosOptions
from .report import summarize
from .swarm import ChaosNode, ChaosSwarm

log = logging.getLogger(__name__)
MIN_BLOCKS = 4
DEADLINE_S = 5.0


def run_chaos(opts: ChaosOptions) -> dict[str, Any]:
    tools = chaos_swarm.fault_tools()
    swarm, members = family_swarm()
    return run_swarm(swarm, lambda: _drive(swarm, members, opts, tools))


def family_swarm(token: bool = False, coordinators: int = 1) -> tuple[ChaosSwarm, list[Path]]:
    """The swarm every chaos run drives: the shipped family's first two members' nodes, each on its own
    host; every member is listed (strict admission), so joiners can run members[-1]."""
    members = robust_members(family_root())
    depth = read_manifest(members[0]).config.depth
    listed = tuple(f"--family-dir={m}" for m in members[2:])
    extra = ("--min-blocks", str(MIN_BLOCKS), *listed)
    return chaos_swarm.build(members[:2], depth, extra, token=token, coordinators=coordinators), members


def run_swarm(swarm: ChaosSwarm, drive: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
    """Start the swarm's nodes and coordinators, run `drive` to its end, and stop everything, however it ends."""
    try:
        swarm.start_nodes(swarm.nodes)
        swarm.start_coordinators()
        return asyncio.run(drive())
    finally:
        swarm.stop()


async def _drive(swarm: ChaosSwarm, members: list[Any], opts: ChaosOptions, tools: dict[str, bool]) -> dict[str, Any]:
    samples = load_samples(members[0])
    poller = Poller(swarm.url)
    await poller.wait_healthy(len(swarm.nodes))
    poll_task = asyncio.create_task(poller.run())
    done, schedule_over = asyncio.Event(), asyncio.Event()
    events: list[dict[str, Any]] = []
    faults = asyncio.create_task(
        _fault_loop(swarm, members, random.Random(opts.seed), tools, opts, events, done, schedule_over)
    )
    try:
        records = await run_load(
            swarm.url, samples, opts.requests, opts.concurrency, DEADLINE_S, until=schedule_over, max_s=opts.max_s
        )
    finally:
        done.set()
        await faults
        poller.stop()
        await poll_task
    for event in events:
        event.update(poller.reaction_times(event))
    report = summarize(records, events, poller.depth_timeline, MIN_BLOCKS, DEADLINE_S)
    report["unavailable"] = {k: "not supported by this kernel or not installed" for k, ok in tools.items() if not ok}
    report["nodes"] = len(swarm.nodes)
    report["nodes_faulted"] = len({e["target"] for e in events if e["target"].startswith("node")})
    report["options"] = vars(opts)
    report["coordinator_errors"] = list(swarm.coordinator.errors) if swarm.coordinator else []  # this incarnation
    t0 = records[0].sent if records else 0.0
    for event in events:
        event["at_s"] = round(event["at"] - t0, 3)
        event["recovered_at_s"] = None if event["recovered_at"] is None else round(event["recovered_at"] - t0, 3)
    report["depth_timeline_around_refusals"] = [
        (round(t - t0, 2), d)
        for t, d in poller.depth_timeline
        if any(abs(t - r["at_s"] - t0) < 1.0 for r in report["non_200_while_min_depth_reachable_examples"])
    ]
    return report


def fault_event(kind: str, node: ChaosNode, **extra: Any) -> dict[str, Any]:
    """A fault's report entry, as every chaos run writes it; `recovered_at` is filled in when it ends."""
    target = "coordinator" if kind == "coordinator" else node.name
    return {
        "kind": kind,
        "target": target,
        "address": node.address,
        "at": time.monotonic(),
        "recovered_at": None,
        **extra,
    }


def load_samples(model_dir: Any, count: int = 200) -> list[tuple[bytes, str]]:
    """Test images of the family's dataset as PNG, with their labels."""
    return list(labelled_samples(task_data(model_dir), range(count)))


async def _fault_loop(
    swarm: ChaosSwarm,
    members: list[Any],
    rng: random.Random,
    tools: dict[str, bool],
    opts: ChaosOptions,
    events: list[dict[str, Any]],
    done: asyncio.Event,
    schedule_over: asyncio.Event,
) -> None:
    """Every available fault kind once, in a seeded order, each on a node not faulted before (up to half
    the swarm over a run), then a fault-free tail."""
    kinds = [
        k for k in chaos_swarm.FAULT_KINDS if (k != "drop" or tools["nftables"]) and (k != "netem" or tools["netem"])
    ]
    untouched = list(swarm.nodes)
    rng.shuffle(untouched)
    await _sleep_or_done(done, opts.warmup_s)
    for spare, kind in enumerate(rng.sample(kinds, len(kinds))):
        if done.is_set():
            break
        node = untouched.pop() if untouched else rng.choice(swarm.nodes)
        event = fault_event(kind, node)
        events.append(event)
        log.info("fault %s on %s", kind, event["target"])
        recover, target = await asyncio.to_thread(_apply, swarm, kind, node, members, spare)
        if target is not node:  # a node that joined: its reaction is admission
            event["target"], event["address"] = target.name, target.address
        await _sleep_or_done(done, opts.hold_s)
        await asyncio.to_thread(recover)
        event["recovered_at"] = time.monotonic()
        await _sleep_or_done(done, 1.0)
    await _sleep_or_done(done, opts.warmup_s)  # a calm tail: re-admissions finish, more fault-free samples
    schedule_over.set()


def _apply(swarm: ChaosSwarm, kind: str, node: ChaosNode, members: list[Any], spare: int) -> Any:
    """Do the fault now; return what undoes it, and the node it concerns."""
    return _do(swarm, kind, node, members, spare)


def _do(swarm: ChaosSwarm, kind: str, node: ChaosNode, members: list[Any], spare: int) -> Any:
    if kind == "kill":
        swarm.kill(node)
        return (lambda: swarm.restart(node)), node  # the same host, port and name: a device reboots
    if kind == "restart":
        swarm.restart(node)
        return (lambda: None), node
    if kind == "freeze":
        swarm.freeze(node, True)
        return (lambda: swarm.freeze(node, False)), node
    if kind == "link":
        node.host.link(up=False)
        return (lambda: node.host.link(up=True)), node
    if kind == "drop":
        swarm.drop_packets(node, True)
        return (lambda: swarm.drop_packets(node, False)), node
    if kind == "netem":
        swarm.netem(node, 300)
        return (lambda: swarm.netem(node, None)), node
    if kind == "slow":
        swarm.restart(node, ("--fault-delay-ms", "400"))
        return (lambda: swarm.restart(node)), node
    if kind == "malformed":
        swarm.restart(node, ("--fault-mode", ["nan", "shape", "dtype"][spare % 3]))
        return (lambda: swarm.restart(node)), node
    if kind == "join":
        joiner = ChaosNode(f"join-{spare}", swarm.lab.add_host(f"join-{spare}"), members[-1], node.block)
        swarm.add_node(joiner)
        swarm.start_nodes([joiner])
        return (lambda: joiner.proc.stop(5) if joiner.proc else None), joiner
    if kind == "coordinator":
        swarm.last_restart = swarm.restart_coordinator()
        return (lambda: None), node
    raise ValueError(f"unknown fault {kind}")


async def _sleep_or_done(done: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(done.wait(), seconds)


class Poller:
    """Reads /v1/nodes ten times a second: node states and reachable depth over time."""

    def __init__(self, url: str, keep_s: float | None = None) -> None:
        self.url = url
        self.keep_s = keep_s  # a soak keeps only the last minutes of node states (bounded memory)
        self.timeline: list[tuple[float, dict[str, str]]] = []
        self.depth_timeline: list[tuple[float, int]] = []
        self._stop = asyncio.Event()

    async def wait_healthy(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            while time.monotonic() < deadline:
                view = (await client.get("/v1/nodes")).json()
                if swarm_is_up(view, count):
                    return
                await asyncio.sleep(0.2)
        raise TimeoutError(f"fewer than {count} nodes became healthy")

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=2) as client:
            while not self._stop.is_set():
                try:
                    view = (await client.get("/v1/nodes")).json()
                except httpx.HTTPError:  # the coordinator is restarting: nothing is reachable through it
                    self.timeline.append((time.monotonic(), {}))
                    self.depth_timeline.append((time.monotonic(), 0))
                    await asyncio.sleep(0.1)
                    continue
                now = time.monotonic()
                self.timeline.append((now, {n["address"]: n["state"] for n in view["nodes"]}))
                if self.keep_s is not None and now - self.timeline[0][0] > 2 * self.keep_s:
                    self.timeline = [(t, s) for t, s in self.timeline if now - t <= self.keep_s]
                self.depth_timeline.append((now, view["reachable_depth"]))
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()

    def latest_states(self) -> dict[str, str]:
        return self.timeline[-1][1] if self.timeline else {}

    def reaction_times(self, event: dict[str, Any]) -> dict[str, float | None]:
        """Seconds from the fault until the node left the routable set, and from recovery until it was
        back. A joining node: seconds until admitted. The coordinator: seconds until it could route again."""
        at, recovered, address, kind = (
            event["at"],
            event["recovered_at"] or float("inf"),
            event["address"],
            event["kind"],
        )
        routed = back = None
        if kind == "coordinator":
            down = next((t for t, d in self.depth_timeline if t >= at and d < MIN_BLOCKS), None)
            if down is not None:
                back = next((t for t, d in self.depth_timeline if t >= down and d >= MIN_BLOCKS), None)
            return {"routed_around_s": None, "readmitted_s": None if back is None else round(back - at, 3)}
        if kind == "join":
            back = self._first(at, lambda states: states.get(address) == "healthy")
            return {"routed_around_s": None, "readmitted_s": None if back is None else round(back - at, 3)}
        if kind not in ("restart", "slow"):
            routed = self._first(at, lambda states: bool(states) and states.get(address, "gone") != "healthy")
        back = self._first(recovered, lambda states: states.get(address) == "healthy")
        return {
            "routed_around_s": None if routed is None else round(routed - at, 3),
            "readmitted_s": None if back is None else round(back - recovered, 3),
        }

    def _first(self, after: float, predicate: Any) -> float | None:
        return next((t for t, states in self.timeline if t >= after and predicate(states)), None)
