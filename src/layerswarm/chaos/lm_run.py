"""`layerswarm chaos --family lm`: streamed generation under faults, liars included.

The shipped language-model family's first two shuffle-robust members, a node per block of each (two per
block index, so a lost cache can be rebuilt on the other), every node its own host on a bridge
(swarm.py), one coordinator holding every member (so it can check decode hops: decode_check.py). Then:

1. no faults: every held-out task prompt streamed once (greedy, `POST /v1/completions`, `stream: true`),
   `concurrency` at once: the text and exact match each prompt gets without faults;
2. with faults: the same prompts again, on until the schedule is over (lm_load.py), while one fault at a
   time lands mid-stream (only while some streams are between their first token and [DONE]), in this
   order, each on its own block index, on the node of the coordinator's own model (the one streams are
   routed through; the sibling's node of the index is where they are rebuilt):
   turncoat    a node redeployed as harness/faults.py's `noise` liar honest for `turncoat_after` Decode
               replies first: past its probation, caught only by the sampled checks
   liar        a node redeployed as a `noise` liar from its first reply: caught on probation
   kill        SIGKILL, held, then started again on the same host and port (a reboot)
   freeze      SIGSTOP, held, SIGCONT
   restart     a graceful restart
   kill-third  a third of the nodes SIGKILLed at once (every index without a liar), held, restarted
   Before each liar, an honest spare of the own model joins its block index (so, once the liar is
   convicted, the index keeps two honest nodes). The liars lie until the end. After the last fault the
   load goes on until `after_streams` streams started once every liar was convicted (the exact match
   after detection) and every honest node hit is routable again, or `tail_s` passed.

The report (lm_report.py) has a verdict table: every stream ended normally, the liars convicted and the
streams they touched rebuilt, no honest node convicted, exact match against the no-fault run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from layerswarm.harness.streams import task_prompts
from layerswarm.models.checkpoint import read_lm_manifest
from layerswarm.models.zoo import resolve_family, robust_members

from . import swarm as chaos_swarm
from .lm_load import StreamLoad
from .lm_report import LIAR_KINDS as LIARS
from .lm_report import lm_report
from .report import environment
from .run import Poller, run_swarm
from .swarm import ChaosNode, ChaosSwarm

log = logging.getLogger(__name__)
LIAR_MODE = "noise"  # Gaussian noise with the real output's mean and std: well-formed, finite, wrong
FAULT_ORDER = ("turncoat", "liar", "kill", "freeze", "restart", "kill-third")
HOP_TIMEOUT_S = 2.0


@dataclass
class LMChaosOptions:
    prompts: int = 100  # distinct held-out task prompts; the no-fault phase streams each once
    streams: int = 400  # streams with faults, at least (on until the schedule is over)
    concurrency: int = 8  # streams at once
    seed: int = 0  # which nodes the faults hit, and which prompts
    hold_s: float = 2.0  # how long a kill, freeze or kill-third lasts
    gap_s: float = 1.0  # calm between faults
    turncoat_after: int = 12  # honest Decode replies before the turncoat lies (past a 2-hop probation)
    after_streams: int = 100  # streams started after every liar was convicted (exact match after detection)
    tail_s: float = 120.0  # at most this long after the last fault waiting for them
    max_s: float = 900.0  # the fault phase never lasts longer
    fault_wait_s: float = 20.0  # a fault waits this long at most for a stream to be mid-way


QUICK = LMChaosOptions(prompts=24, streams=48, concurrency=6, hold_s=1.0, gap_s=0.5, after_streams=24, tail_s=60)


def run_lm_chaos(opts: LMChaosOptions) -> dict[str, Any]:
    swarm, members = lm_swarm()
    return run_swarm(swarm, lambda: _drive(swarm, members, opts))


def lm_swarm() -> tuple[ChaosSwarm, list[Path]]:
    """Both first members' nodes, each its own host; the coordinator holds every member (--family-dir),
    so every decode hop it samples is checked against its own copy. A stream may skip one block (--min-
    blocks depth - 1) should both nodes of an index be gone at once; the schedule never does that."""
    members = robust_members(resolve_family("lm"))
    depth = read_lm_manifest(members[0]).config.depth
    # The coordinator's default hop timeout, not the classification run's 0.5 s: on a starved 2-core
    # machine 0.5 s ejected both nodes of an index at once (a stream then failed below the minimum).
    extra = (
        "--min-blocks",
        str(depth - 1),
        "--hop-timeout",
        str(HOP_TIMEOUT_S),
        *(f"--family-dir={m}" for m in members[2:]),
    )
    return chaos_swarm.build(members[:2], depth, extra, token=True), members


async def _drive(swarm: ChaosSwarm, members: list[Path], opts: LMChaosOptions) -> dict[str, Any]:
    at_start = environment()
    tasks = task_prompts(members[0], opts.prompts, opts.seed)
    poller = Poller(swarm.url)
    await poller.wait_healthy(len(swarm.nodes), timeout=120.0)
    model = await _model_id(swarm.url)
    polling = asyncio.create_task(poller.run())
    try:
        calm = StreamLoad(swarm.url, model, tasks, opts.concurrency)
        no_faults = await calm.run(len(tasks), max_s=opts.max_s)
        load = StreamLoad(swarm.url, model, tasks, opts.concurrency)
        schedule = LMSchedule(swarm, members[0], opts, load, poller)
        over = asyncio.Event()
        faults = asyncio.create_task(schedule.run(over))
        try:
            with_faults = await load.run(opts.streams, until=over, max_s=opts.max_s)
        finally:
            schedule.stop()
            await faults
        view, metrics = await _coordinator_view(swarm.url)
    finally:
        poller.stop()
        await polling
    report = lm_report(no_faults, with_faults, tasks, schedule, poller, view, metrics, opts)
    report["environment"] = {"start": at_start, "end": environment()}
    report["nodes"] = len([n for n in swarm.nodes if n.name not in schedule.spares])
    report["spares_joined"] = schedule.spares
    report["members"] = [m.name for m in members[:2]]
    report["coordinator_errors"] = list(swarm.coordinator.errors) if swarm.coordinator else []
    return report


async def _model_id(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return str((await client.get("/v1/models")).json()["data"][0]["id"])


async def _coordinator_view(url: str) -> tuple[dict[str, Any], str]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return (await client.get("/v1/nodes")).json(), (await client.get("/metrics")).text


class LMSchedule:
    """The seeded fault schedule of a generation chaos run; remembers what it did."""

    def __init__(self, swarm: ChaosSwarm, own: Path, opts: LMChaosOptions, load: StreamLoad, poller: Poller) -> None:
        self.swarm, self.own, self.opts, self.load, self.poller = swarm, own, opts, load, poller
        self.rng = random.Random(opts.seed)
        self.events: list[dict[str, Any]] = []
        self.liars: list[dict[str, Any]] = []
        self.spares: list[str] = []  # honest nodes that joined a liar's block index
        self._done = asyncio.Event()
        blocks = sorted({n.block for n in swarm.nodes})
        order = self.rng.sample(blocks, len(blocks))
        self.liar_blocks = order[: len(LIARS)]
        self.fault_blocks = order[len(LIARS) :]

    def stop(self) -> None:
        self._done.set()

    def convicted_at(self) -> float | None:
        """When the last liar was first seen quarantined (None: some liar not yet)."""
        times = [self._quarantined_since(liar) for liar in self.liars]
        return None if not times or None in times else max(t for t in times if t is not None)

    def _quarantined_since(self, liar: dict[str, Any]) -> float | None:
        address, since = liar["address"], liar["at"]
        return next((t for t, s in self.poller.timeline if t >= since and s.get(address) == "quarantined"), None)

    async def run(self, over: asyncio.Event) -> None:
        try:
            await self._sleep(self.opts.gap_s)
            for n, kind in enumerate(FAULT_ORDER):
                if self._done.is_set():
                    break
                await self._one(kind, n)
                await self._sleep(self.opts.gap_s)
            await self._tail()
        finally:
            for liar in self.liars:
                liar["convicted_at"] = self._quarantined_since(liar)
            over.set()

    async def _tail(self) -> None:
        """Until `after_streams` streams started after every liar's conviction and every honest node
        faulted is routable again, or `tail_s` passed."""
        deadline = time.monotonic() + self.opts.tail_s
        while not self._done.is_set() and time.monotonic() < deadline:
            caught = self.convicted_at()
            enough = caught is not None and len(self.load.started_after(caught)) >= self.opts.after_streams
            if enough and self._all_back():
                return
            await self._sleep(0.2)

    def _all_back(self) -> bool:
        states = self.poller.latest_states()
        back = [states.get(a) == "healthy" for e in self.events if e["kind"] not in LIARS for a in e["addresses"]]
        return all(back)

    async def _one(self, kind: str, n: int) -> None:
        live = await self._wait_mid_stream()
        nodes = self._targets(kind, n)
        event = {
            "kind": kind,
            "targets": [node.name for node in nodes],
            "addresses": [node.address for node in nodes],
            "blocks": [node.block for node in nodes],
            "at": time.monotonic(),
            "recovered_at": None,
            "streams_mid_way": live,
        }
        self.events.append(event)
        log.info("fault %s on %s with %d streams mid-way", kind, event["targets"], len(live))
        if kind in LIARS:
            await asyncio.to_thread(self._redeploy_liar, kind, nodes[0])
            event["recovered_at"] = time.monotonic()  # the liar serves (and lies) until the end
            return
        undo = await asyncio.to_thread(self._apply, kind, nodes)
        await self._sleep(self.opts.hold_s)
        await asyncio.to_thread(undo)
        event["recovered_at"] = time.monotonic()

    def _targets(self, kind: str, n: int) -> list[ChaosNode]:
        """The own model's node of a block index: the one streams are routed through (routes.py takes the
        coordinator's own model first; the sibling's node of the index is where a stream is rebuilt)."""
        if kind in LIARS:
            return [self._carrier(self.liar_blocks[LIARS.index(kind)])]
        if kind == "kill-third":  # every index without a liar: its sibling's node carries the streams
            return [self._carrier(b) for b in self.fault_blocks]
        return [self._carrier(self.fault_blocks[n % len(self.fault_blocks)])]

    def _carrier(self, block: int) -> ChaosNode:
        own = [node for node in self.swarm.nodes if node.block == block and node.model_dir == self.own]
        return own[0]  # the first of the swarm: never a spare

    def _redeploy_liar(self, kind: str, node: ChaosNode) -> None:
        """An honest spare of the same model and block joins first (as the attack run's pair gets an honest
        third replica): once the liar is convicted its index keeps two honest nodes, so a slow health
        check on one never leaves the index empty; then the node is redeployed as the liar."""
        spare = ChaosNode(f"spare-b{node.block}", self.swarm.lab.add_host(f"spare-b{node.block}"), self.own, node.block)
        self.swarm.add_node(spare)
        self.swarm.start_nodes([spare])
        self.spares.append(spare.name)
        after = self.opts.turncoat_after if kind == "turncoat" else 0
        started = time.monotonic()
        self.swarm.restart(node, ("--fault-mode", LIAR_MODE, "--fault-after", str(after)))
        self.liars.append(
            {
                "kind": kind,
                "mode": LIAR_MODE,
                "honest_replies_first": after,
                "target": node.name,
                "address": node.address,
                "block": node.block,
                "redeployed_at": started,
                "at": time.monotonic(),  # serving from here
            }
        )

    def _apply(self, kind: str, nodes: list[ChaosNode]) -> Any:
        """Do the fault now; return what undoes it."""
        swarm = self.swarm
        if kind in ("kill", "kill-third"):
            for node in nodes:
                swarm.kill(node)
            return lambda: swarm.start_nodes(nodes)  # the same hosts, ports and names: devices reboot
        if kind == "freeze":
            swarm.freeze(nodes[0], True)
            return lambda: swarm.freeze(nodes[0], False)
        if kind == "restart":
            swarm.restart(nodes[0])
            return lambda: None
        raise ValueError(f"unknown fault {kind}")

    async def _wait_mid_stream(self) -> list[int]:
        """The streams mid-way once some are (at most `fault_wait_s`): a fault lands while they run."""
        deadline = time.monotonic() + self.opts.fault_wait_s
        while not self.load.live() and time.monotonic() < deadline and not self._done.is_set():
            await asyncio.sleep(0.01)
        return self.load.live()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._done.wait(), seconds)
