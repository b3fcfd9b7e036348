"""`layerswarm chaos` (the default run): the failure schedule of run.py extended with attackers.

A token-protected swarm (both members' nodes, each its own host), a no-fault baseline of
`baseline_requests`, then one fault at a time on a seeded schedule:

- rogue nodes (harness/faults.py: zeros, other-block, noise), each on its own block index, lying until
  the end of the run: verification must quarantine them; among them a turncoat (honest for
  TURNCOAT_AFTER replies, past its probation, then a subtle targeted liar: faults.py push) and a
  colluding pair (both nodes of one block index, one per member, redeployed as the same push liar after
  an honest third node of that block joined: two replicas that agree, against one honest);
- a forging device on its own host (forging.py): forged goodbyes for every real node and adverts of
  another family pointing at them; an impostor that advertises itself with real zeroconf, records what
  the coordinator sends and replays it to the real node;
- every fault kind of the basic run (kill, freeze, pulled cable, dropped packets, netem, slow,
  malformed, restart, a joining node, a coordinator restart), each on a node not faulted before, never
  on a block that holds a rogue (its other node must carry it);
- with `coordinators` > 1 (coordinators.py): that many coordinators, each told of the others, the load
  through the Python client with all their URLs, and every coordinator SIGKILLed and restarted in turn
  instead of the graceful coordinator restart.

The report carries a `checks` table (target, measured, pass/fail) built by checks.py.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from layerswarm.wire.stats import quantile

from . import swarm as chaos_swarm
from .checks import attack_checks, render_checks
from .coordinators import (
    CoordinatorRun,
    client_figures,
    coordinator_checks,
    kill_each_in_turn,
    liar_avoidance,
    relative_times,
    render_coordinators,
    run_failover_load,
)
from .forging import ForgingDevice
from .load import Record, run_load
from .report import environment, render, summarize
from .run import DEADLINE_S, MIN_BLOCKS, Poller, _do, _sleep_or_done, family_swarm, fault_event, load_samples, run_swarm
from .swarm import ChaosNode, ChaosSwarm

log = logging.getLogger(__name__)
HOP_DEADLINE_S = 0.5  # the chaos coordinator's --hop-timeout
FAULT_SETTLE_S = 10.0  # a fault recovered this long before a forging round may still show in node states
ROGUE_MODES = ("zeros", "other-block", "turncoat", "pair", "noise")
TURNCOAT_AFTER = 20  # honest replies before the turncoat lies: past its probation (docs/trust-verification.md)
# A rogue's harness/faults.py arguments where they are not just its mode's name.
ROGUE_ARGS = {
    "turncoat": ("--fault-mode", "push", "--fault-after", str(TURNCOAT_AFTER)),
    "pair": ("--fault-mode", "push"),  # both push toward the same class: they agree on the lie
}


@dataclass
class AttackOptions:
    requests: int = 5000
    baseline_requests: int = 1000  # fault-free requests first: the no-fault accuracy and p99
    concurrency: int = 8
    seed: int = 0
    hold_s: float = 2.0
    gap_s: float = 1.0  # calm between faults
    tail_s: float = 3.0  # calm after the last fault
    listen_s: float = 4.0  # how long the impostor listens for the coordinator
    # How long a client retries a refused connection (the coordinator restarting) before the request
    # counts as lost; None: the 5 s request deadline.
    connect_patience_s: float | None = None
    rogues: int = len(ROGUE_MODES)  # the first this many of ROGUE_MODES
    basic_kinds: tuple[str, ...] = chaos_swarm.FAULT_KINDS
    max_s: float = 1500.0
    coordinators: int = 1  # more: each SIGKILLed and restarted in turn, clients fail over (coordinators.py)
    kill_gap_s: float = 2.0  # between one coordinator ready again and the next killed
    balanced_workers: int = 1  # several coordinators: workers sending through HAProxy (where installed)


def run_attack(opts: AttackOptions) -> dict[str, Any]:
    swarm, members = family_swarm(token=True, coordinators=opts.coordinators)
    forger = ForgingDevice(swarm)
    return run_swarm(swarm, lambda: _drive(swarm, members, forger, opts))


async def _drive(swarm: ChaosSwarm, members: list[Any], forger: ForgingDevice, opts: AttackOptions) -> dict[str, Any]:
    samples = load_samples(members[0])
    at_start = environment()
    tools = chaos_swarm.fault_tools()
    pollers = [Poller(url) for url in swarm.urls]  # the first coordinator's is the report's
    poller = pollers[0]
    for each in pollers:
        await each.wait_healthy(len(swarm.nodes))
    poll_tasks = [asyncio.create_task(each.run()) for each in pollers]
    done, over, load_over = asyncio.Event(), asyncio.Event(), asyncio.Event()
    records: list[Record] = []
    schedule = Schedule(swarm, members, forger, poller, opts, tools, records)
    task = asyncio.create_task(schedule.run(done, over))
    several, crun = len(swarm.urls) > 1, CoordinatorRun(swarm)
    killing = asyncio.create_task(
        kill_each_in_turn(swarm, schedule.baseline_over, done, opts.kill_gap_s, crun.kills, crun.tips)
        if several
        else asyncio.sleep(0)
    )
    ending = asyncio.create_task(_both(over, killing, load_over))
    try:
        await _load(swarm, samples, opts, load_over, records, crun)
    finally:
        crun.stop()
        done.set()
        await task
        await killing
        ending.cancel()
        for each in pollers:
            each.stop()
        await asyncio.gather(*poll_tasks)
    records.sort(key=lambda r: r.index)
    events = schedule.events
    for event in events:
        event.update(poller.reaction_times(event))
    report = summarize(records, events, poller.depth_timeline, MIN_BLOCKS, DEADLINE_S)
    report["baseline"] = _baseline(records[: opts.baseline_requests])
    if several:  # before _rogue_result rewrites the rogues' times
        report["coordinators"] = _coordinators_section(swarm, schedule, pollers, records, crun)
    report["rogues"] = [_rogue_result(r, records, poller) for r in schedule.rogues]
    report["pair_third_replicas"] = schedule.honest_added  # honest: the pair is two against one
    report["after_detection"] = _after_detection(report["rogues"], records)
    report["forging_device"] = {**forger.summary(), "attacks": schedule.attack_results}
    report["nodes"] = len([n for n in swarm.nodes if n.name != "joiner" and not n.name.startswith("join-")])
    report["nodes_faulted"] = len({e["target"] for e in events if e["target"].startswith("node")})
    report["unavailable"] = {k: "not supported by this kernel or not installed" for k, ok in tools.items() if not ok}
    report["hop_deadline_ms"] = HOP_DEADLINE_S * 1e3
    report["options"] = {k: v for k, v in vars(opts).items()}
    t0 = records[0].sent if records else 0.0
    _relative(events, report["rogues"], t0)
    report["environment"] = {"start": at_start, "end": environment()}
    report["checks"] = attack_checks(report, opts)
    if several:
        relative_times(report["coordinators"], t0)
        report["checks"] += coordinator_checks(report["coordinators"])
    return report


def _relative(events: list[dict[str, Any]], rogues: list[dict[str, Any]], t0: float) -> None:
    """Monotonic instants as seconds since the run's first request."""
    for event in events:
        event["at_s"] = round(event["at"] - t0, 3)
        event["recovered_at_s"] = None if event["recovered_at"] is None else round(event["recovered_at"] - t0, 3)
        del event["at"], event["recovered_at"]
    for rogue in rogues:
        rogue["lying_from_s"] = round(rogue.pop("lying_from") - t0, 3)


async def _load(
    swarm: ChaosSwarm,
    samples: list[Any],
    opts: AttackOptions,
    until: asyncio.Event,
    records: list[Record],
    crun: CoordinatorRun,
) -> None:
    """One coordinator: load.run_load's clients (connection retries bridge its restart); several: the
    Python client, failing over between them, and `balanced_workers` through HAProxy (coordinators.py)."""
    if len(swarm.urls) > 1:
        balancer = await asyncio.to_thread(crun.start_balancer) if opts.balanced_workers else None
        crun.balanced_workers = opts.balanced_workers if balancer else 0
        await run_failover_load(
            swarm.urls,
            samples,
            opts.requests,
            opts.concurrency,
            DEADLINE_S,
            until,
            opts.max_s,
            records,
            balancer,
            crun.balanced_workers,
        )
        return
    await run_load(
        swarm.url,
        samples,
        opts.requests,
        opts.concurrency,
        DEADLINE_S,
        until=until,
        max_s=opts.max_s,
        records=records,
        connect_patience_s=opts.connect_patience_s,
    )


async def _both(over: asyncio.Event, killing: asyncio.Task[None], load_over: asyncio.Event) -> None:
    """The load ends once the schedule is over and every coordinator was killed and is back."""
    await over.wait()
    await asyncio.wait([killing])
    load_over.set()


def _coordinators_section(
    swarm: ChaosSwarm,
    schedule: Schedule,
    pollers: list[Poller],
    records: list[Record],
    crun: CoordinatorRun,
) -> dict[str, Any]:
    timelines = {url: p.timeline for url, p in zip(swarm.urls, pollers, strict=True)}
    return {
        "urls": swarm.urls,
        "kills": crun.kills,
        "clients": client_figures(records, swarm.urls, crun.balancer.url if crun.balancer else None),
        "tips_acted": crun.tips.by_url(),
        "balancer": {
            "url": crun.balancer.url if crun.balancer else None,
            "workers": crun.balanced_workers,
            "not_started": crun.balancer_note,
        },
        "liars": liar_avoidance(schedule.rogues, timelines, records),
        "errors": {
            url: list(proc.errors) if proc else []
            for url, proc in zip(swarm.urls, [swarm.coordinator, *(c.proc for c in swarm.others)], strict=True)
        },
    }


class Schedule:
    """The seeded fault and attack schedule; remembers what it did."""

    def __init__(
        self,
        swarm: ChaosSwarm,
        members: list[Any],
        forger: ForgingDevice,
        poller: Poller,
        opts: AttackOptions,
        tools: dict[str, bool],
        records: list[Record],
    ) -> None:
        self.swarm, self.members, self.forger, self.poller = swarm, members, forger, poller
        self.opts, self.records = opts, records
        self.rng = random.Random(opts.seed)
        self.kinds = [
            k for k in opts.basic_kinds if (k != "drop" or tools["nftables"]) and (k != "netem" or tools["netem"])
        ]
        if len(swarm.urls) > 1:  # the coordinators are SIGKILLed in turn instead (coordinators.py)
            self.kinds = [k for k in self.kinds if k != "coordinator"]
        self.baseline_over = asyncio.Event()
        self.events: list[dict[str, Any]] = []
        self.rogues: list[dict[str, Any]] = []
        self.starting: list[asyncio.Task[None]] = []  # rogue redeployments under way
        self.attack_results: list[dict[str, Any]] = []
        self.honest_added: list[str] = []  # the pair's honest third replica
        blocks = sorted({n.block for n in swarm.nodes})
        self.rng.shuffle(blocks)
        self.rogue_blocks = blocks[: opts.rogues]
        others = [n for n in swarm.nodes if n.block not in self.rogue_blocks]
        self.rng.shuffle(others)
        self.untouched = others

    async def run(self, done: asyncio.Event, over: asyncio.Event) -> None:
        while len(self.records) < self.opts.baseline_requests and not done.is_set():
            await asyncio.sleep(0.1)
        self.baseline_over.set()
        steps: list[str] = [f"rogue:{m}" for m in ROGUE_MODES[: self.opts.rogues]]
        steps += ["forge", "steal", *self.rng.sample(self.kinds, len(self.kinds))]
        # Rogues and attacks first, interleaved with the basic faults: the rest runs with rogues lying.
        order = steps[: self.opts.rogues] + self.rng.sample(steps[self.opts.rogues :], len(steps) - self.opts.rogues)
        order = _interleave(order[: self.opts.rogues], order[self.opts.rogues :])
        for step in order:
            if done.is_set():
                break
            await self._step(step, done)
            await _sleep_or_done(done, self.opts.gap_s)
        await asyncio.gather(*self.starting)
        # A calm tail: re-admissions finish; then more requests until the count is reached.
        await _sleep_or_done(done, self.opts.tail_s)
        over.set()

    async def _step(self, step: str, done: asyncio.Event) -> None:
        if step.startswith("rogue:"):  # redeployed in the background: the schedule goes on meanwhile
            block, mode = self.rogue_blocks[len(self.starting)], step.partition(":")[2]
            holders = [n for n in self.swarm.nodes if n.block == block]
            liars = holders if mode == "pair" else [self.rng.choice(holders)]
            self.starting.append(asyncio.create_task(self._rogue(liars, mode)))
            await _sleep_or_done(done, self.opts.hold_s)
            return
        if step in ("forge", "steal"):
            await self._attack(step)
            return
        node = (
            self.untouched.pop()
            if self.untouched
            else self.rng.choice([n for n in self.swarm.nodes if n.block not in self.rogue_blocks])
        )
        event = self._event(step, node)
        log.info("fault %s on %s", step, event["target"])
        recover, target = await asyncio.to_thread(_do, self.swarm, step, node, self.members, len(self.events))
        if target is not node:  # a node that joined: its reaction is admission
            event["target"], event["address"] = target.name, target.address
        if step == "coordinator":
            event.update(self.swarm.last_restart)
        await _sleep_or_done(done, self.opts.hold_s)
        await asyncio.to_thread(recover)
        event["recovered_at"] = time.monotonic()

    async def _rogue(self, nodes: list[ChaosNode], mode: str) -> None:
        """Redeploy `nodes` as liars (a pair together); each lies from its ready line (a turncoat after
        its honest replies: its detection is counted from its ready line too) until the end of the run."""
        faults = ROGUE_ARGS.get(mode, ("--fault-mode", mode))
        if mode == "pair":  # first an honest third replica of the block: two that agree against one honest
            await asyncio.to_thread(self._third_replica, nodes[0].block)
        for node in nodes:
            log.info("rogue %s on %s", mode, node.name)
            self._event("rogue", node, mode=mode)  # before the restart: its downtime is the schedule's doing
            await asyncio.to_thread(self.swarm.restart, node, faults)
            lying_from = time.monotonic()
            self.rogues.append({"mode": mode, "target": node.name, "address": node.address, "lying_from": lying_from})

    def _third_replica(self, block: int) -> None:
        """An honest node for `block` (the last member's, as the pair's m1 node holds) on its own host:
        with it the pair is a colluding majority of two against one, and the block survives their
        conviction (without it, both replicas lie and the block is simply gone)."""
        node = ChaosNode(f"third-b{block}", self.swarm.lab.add_host(f"third-b{block}"), self.members[-1], block)
        self.swarm.add_node(node)
        self.swarm.start_nodes([node])
        self.honest_added.append(node.address)

    async def _attack(self, kind: str) -> None:
        before = self.poller.latest_states()
        healthy = {a for a, s in before.items() if s == "healthy"}
        started = time.monotonic()
        result = await asyncio.to_thread(self.forger.run_round, kind, self.opts.listen_s, self.swarm.token)
        await asyncio.sleep(1.5)  # several health rounds (0.25 s apart) after the last forged packet
        # A real node that was healthy and is no longer, from the attack on: the forgery won. Nodes the
        # schedule itself disturbed around then (a freeze, a kill, a rogue, still being re-admitted) are
        # left out: their state says what the fault did, not what the forger did.
        disturbed = self._disturbed_since(started - FAULT_SETTLE_S)
        seen: dict[str, set[str]] = {}
        for t, states in self.poller.timeline:
            for a in healthy - disturbed if t >= started and states else ():
                if states.get(a) != "healthy":
                    seen.setdefault(a, set()).add(str(states.get(a)))
        flipped = sorted(seen)
        summary = {k: v for k, v in result.items() if k != "captured"}
        summary["methods_captured"] = sorted({m for m, _ in result.get("captured", [])})
        summary["real_nodes_flipped"] = flipped
        summary["flipped_to"] = {a: sorted(states) for a, states in seen.items()}  # what they became
        summary["healthy_before"] = len(healthy)
        self.attack_results.append(summary)

    def _disturbed_since(self, since: float) -> set[str]:
        """Addresses of the schedule's own faults still on, or recovered after `since` (monotonic)."""
        return {
            str(e["address"])
            for e in self.events
            if e.get("address") and (e.get("recovered_at") is None or e["recovered_at"] >= since)
        }

    def _event(self, kind: str, node: ChaosNode, **extra: Any) -> dict[str, Any]:
        event = fault_event(kind, node, **extra)
        if kind == "rogue":
            event["recovered_at"] = None  # lies to the end: "during the fault" means after it started
        self.events.append(event)
        return event


def _interleave(first: list[str], rest: list[str]) -> list[str]:
    """The rogues spread over the first half of the schedule, so detection happens under other faults."""
    out: list[str] = []
    gap = max(1, len(rest) // (2 * max(1, len(first))))
    for i, rogue in enumerate(first):
        out.append(rogue)
        out.extend(rest[i * gap : (i + 1) * gap])
    out.extend(rest[len(first) * gap :])
    return out


def _baseline(records: list[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.status == 200]
    lat = [r.latency_s * 1e3 for r in ok]
    return {
        "requests": len(records),
        "accuracy": round(sum(bool(r.correct) for r in ok) / len(ok), 4) if ok else None,
        "p99_ms": round(quantile(lat, 0.99), 1) if lat else None,
        "p50_ms": round(quantile(lat, 0.5), 1) if lat else None,
    }


def _rogue_result(rogue: dict[str, Any], records: list[Record], poller: Poller) -> dict[str, Any]:
    """When the coordinator first showed the rogue quarantined: seconds and requests since it began lying."""
    start = rogue["lying_from"]
    caught = next(
        (t for t, states in poller.timeline if t >= start and states.get(rogue["address"]) == "quarantined"), None
    )
    out = {**rogue}
    out["detected_after_s"] = None if caught is None else round(caught - start, 3)
    out["detected_after_requests"] = None if caught is None else sum(1 for r in records if start <= r.sent < caught)
    out["detected_at"] = caught
    return out


def _after_detection(rogues: list[dict[str, Any]], records: list[Record]) -> dict[str, Any]:
    """Requests sent after every rogue was shown quarantined: their accuracy and latency."""
    times = [r.pop("detected_at") for r in rogues]
    if not rogues or any(t is None for t in times):
        return {"requests": 0, "accuracy": None, "note": "not every rogue was detected"}
    after = [r for r in records if r.sent >= max(t for t in times if t is not None)]
    ok = [r for r in after if r.status == 200]
    return {
        "requests": len(after),
        "answered_200": len(ok),
        "accuracy": round(sum(bool(r.correct) for r in ok) / len(ok), 4) if ok else None,
    }


def quick_options(seed: int = 0, coordinators: int = 1) -> AttackOptions:
    """The CI variant: four rogues (zeros, other-block, the turncoat, the colluding pair), the forging
    device, a kill, freezes, pulled cables and a coordinator restart (several coordinators: each
    SIGKILLed in turn instead): half the nodes faulted, in about a minute of load."""
    return AttackOptions(
        requests=500,
        baseline_requests=150,
        concurrency=4,
        seed=seed,
        hold_s=1.0,
        gap_s=0.5,
        tail_s=2.0,
        listen_s=3.0,
        rogues=4,
        # A starved CI machine restarts the coordinator slower than the 5 s request deadline (import
        # time): clients wait for it longer here; the full run keeps the deadline.
        connect_patience_s=15.0,
        # Cheap faults (no process start) so that half the nodes are faulted in CI time.
        basic_kinds=("kill", "freeze", "link", "freeze", "link", "freeze", "coordinator"),
        max_s=300.0,
        coordinators=coordinators,
    )


def render_attack(report: dict[str, Any]) -> str:
    lines = [
        render(report),
        "",
        "| rogue | node | detected after (s) | requests until detected |",
        "| --- | --- | --- | --- |",
    ]
    for r in report["rogues"]:
        lines.append(f"| {r['mode']} | {r['target']} | {r['detected_after_s']} | {r['detected_after_requests']} |")
    if "coordinators" in report:
        lines += ["", *render_coordinators(report["coordinators"])]
    lines += ["", render_checks(report["checks"])]
    return "\n".join(lines)
