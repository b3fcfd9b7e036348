"""`layerswarm chaos --soak`: continuous churn for a fixed time (default 30 minutes) against the chaos
swarm, with the coordinator never restarted, so its resident memory and open files at the start and at
the end can be compared; node processes are sampled too (those never restarted give a like-for-like
start/end). Churn: kills and restarts, freezes, pulled cables, slow and malformed nodes, rogue nodes
(zeros, noise, other-block) coming and going, a joiner coming and going, and a forging device's forged
goodbyes and adverts. One fault at a time, never on a block whose other node is not healthy."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from .forging import ForgingDevice
from .load import run_load
from .report import environment, summarize
from .resources import FLAT_FROM_S, FLAT_KEYS, FLAT_WITHIN_PCT, Flatness, coordinator_sample, flatness, proc_resources
from .run import DEADLINE_S, MIN_BLOCKS, Poller, _do, _sleep_or_done, family_swarm, load_samples, run_swarm
from .swarm import HTTP_PORT, NODE_PORT, ChaosNode, ChaosSwarm

log = logging.getLogger(__name__)
# Node faults (run.py's), rogue redeploys, and the forging device's attacks; no coordinator restart.
SOAK_KINDS = ("kill", "freeze", "link", "slow", "malformed", "restart", "rogue", "join", "forge", "steal")
ROGUE_MODES = ("zeros", "noise", "other-block")


@dataclass
class SoakOptions:
    duration_s: float = 1800.0
    concurrency: int = 4
    seed: int = 0
    hold_s: float = 3.0  # how long each fault lasts
    gap_s: float = 2.0  # calm between faults
    sample_every_s: float = 60.0  # resource samples
    flat_from_s: float = FLAT_FROM_S  # the coordinators' flatness is judged from this sample on


def run_soak(opts: SoakOptions) -> dict[str, Any]:
    swarm, members = family_swarm(token=True)
    forger = ForgingDevice(swarm)
    return run_swarm(swarm, lambda: _drive(swarm, members, forger, opts))


async def _drive(swarm: ChaosSwarm, members: list[Any], forger: ForgingDevice, opts: SoakOptions) -> dict[str, Any]:
    samples = load_samples(members[0])
    at_start = environment()
    poller = Poller(swarm.url, keep_s=120.0)
    await poller.wait_healthy(len(swarm.nodes))
    resources: list[dict[str, Any]] = [resource_sample(swarm, 0.0)]
    t0 = time.monotonic()
    poll_task = asyncio.create_task(poller.run())
    done, over = asyncio.Event(), asyncio.Event()
    events: list[dict[str, Any]] = []
    joiner = ChaosNode("joiner", swarm.lab.add_host("joiner"), members[-1], 0)
    churn = asyncio.create_task(_churn(swarm, members, forger, joiner, poller, opts, events, done, over))
    sampler = asyncio.create_task(_sample(swarm, t0, opts.sample_every_s, resources, over))
    try:
        records = await run_load(
            swarm.url, samples, 0, opts.concurrency, DEADLINE_S, until=over, max_s=opts.duration_s + 120.0
        )
    finally:
        done.set()
        over.set()
        await churn
        await sampler
        poller.stop()
        await poll_task
    await asyncio.sleep(1.0)
    resources.append(resource_sample(swarm, time.monotonic() - t0))
    report = summarize(records, events, poller.depth_timeline, MIN_BLOCKS, DEADLINE_S)
    report["faults"] = _fault_counts(events)
    for event in events:
        event["at_s"] = round(event["at"] - t0, 1)
    keys = ("kind", "target", "at_s", "mode", "harness_error")
    report["fault_log"] = [{k: e[k] for k in keys if k in e} for e in events]
    report["harness_errors"] = sum("harness_error" in e for e in events)
    report["forging_device"] = forger.summary()
    report["duration_s"] = round(time.monotonic() - t0, 1)
    report["options"] = vars(opts)
    report["environment"] = {"start": at_start, "end": environment()}
    report["resources"] = {"samples": resources, "start_end": start_end(resources)}
    report["flat"] = {
        "rule": f"max from {opts.flat_from_s:.0f} s to the end within {FLAT_WITHIN_PCT}% of the value then",
        "coordinators": flat_checks(resources, opts.flat_from_s),
    }
    report["coordinator_errors"] = list(swarm.coordinator.errors) if swarm.coordinator else []
    return report


async def _churn(
    swarm: ChaosSwarm,
    members: list[Any],
    forger: ForgingDevice,
    joiner: ChaosNode,
    poller: Poller,
    opts: SoakOptions,
    events: list[dict[str, Any]],
    done: asyncio.Event,
    over: asyncio.Event,
) -> None:
    rng = random.Random(opts.seed)
    end = time.monotonic() + opts.duration_s
    await _sleep_or_done(done, opts.gap_s)
    while not done.is_set() and time.monotonic() + opts.hold_s + opts.gap_s < end:
        kind = rng.choice(SOAK_KINDS)
        node = _pick(swarm, poller, rng)
        if node is None:  # every block is still degraded: wait for re-admissions
            await _sleep_or_done(done, 1.0)
            continue
        event: dict[str, Any] = {"kind": kind, "target": node.name, "at": time.monotonic(), "recovered_at": None}
        if kind == "rogue":
            event["mode"] = rng.choice(ROGUE_MODES)
        events.append(event)
        log.info("soak fault %s on %s", kind, node.name)
        try:  # a harness step that fails (a node that will not start) is recorded; the soak goes on
            recover = await asyncio.to_thread(_apply, swarm, kind, node, members, forger, joiner, event)
            await _sleep_or_done(done, opts.hold_s)
            await asyncio.to_thread(recover)
        except Exception as exc:  # noqa: BLE001 - any harness failure is reported, not fatal to the soak
            log.warning("soak fault %s on %s failed: %s", kind, node.name, exc)
            event["harness_error"] = f"{type(exc).__name__}: {exc}"[:300]
        event["recovered_at"] = time.monotonic()
        await _sleep_or_done(done, opts.gap_s)
    over.set()


def _apply(
    swarm: ChaosSwarm,
    kind: str,
    node: ChaosNode,
    members: list[Any],
    forger: ForgingDevice,
    joiner: ChaosNode,
    event: dict[str, Any],
) -> Any:
    if kind == "rogue":
        swarm.restart(node, ("--fault-mode", event["mode"]))
        return lambda: swarm.restart(node)
    if kind == "forge":
        forger.attack_round()
        return lambda: None
    if kind == "steal":
        forger.run_round("steal", listen_s=3.0, token=swarm.token)
        return lambda: None
    if kind == "join":  # the same spare device joins and leaves: no host per join
        event["target"] = joiner.name
        joiner.block = node.block
        if joiner not in swarm.nodes:
            swarm.add_node(joiner)
        swarm.start_nodes([joiner])
        return lambda: joiner.proc.stop(5) if joiner.proc else None
    recover, _ = _do(swarm, kind, node, members, len(event))
    return recover


def _pick(swarm: ChaosSwarm, poller: Poller, rng: random.Random) -> ChaosNode | None:
    """A node of a block whose every node is healthy (so its other node carries the block)."""
    states = poller.latest_states()
    blocks: dict[int, list[ChaosNode]] = {}
    for node in swarm.nodes:
        if node.name != "joiner":
            blocks.setdefault(node.block, []).append(node)
    whole = [b for b, nodes in blocks.items() if all(states.get(n.address) == "healthy" for n in nodes)]
    if not whole:
        return None
    return rng.choice(blocks[rng.choice(whole)])


async def _sample(swarm: ChaosSwarm, t0: float, every: float, out: list[dict[str, Any]], over: asyncio.Event) -> None:
    while not over.is_set():
        await _sleep_or_done(over, every)
        out.append(await asyncio.to_thread(resource_sample, swarm, time.monotonic() - t0))


def coordinators(swarm: ChaosSwarm) -> dict[str, tuple[int, str]]:
    """Each live coordinator of the swarm: name -> (PID, URL)."""
    proc = swarm.coordinator
    return {"coordinator": (proc.pid, swarm.url)} if proc is not None and proc.alive else {}


def resource_sample(swarm: ChaosSwarm, at_s: float) -> dict[str, Any]:
    sample: dict[str, Any] = {"at_s": round(at_s, 1), "nodes": {}, "coordinators": {}}
    for name, (pid, url) in coordinators(swarm).items():
        sample["coordinators"][name] = coordinator_sample(pid, url, HTTP_PORT, NODE_PORT)
    for node in swarm.nodes:
        if node.proc is not None and node.proc.alive:
            sample["nodes"][node.name] = proc_resources(node.proc.pid)
    return sample


def coordinator_series(samples: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per coordinator, its samples in time order (each with at_s); a restarted one's PID changes."""
    series: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        for name, r in sample["coordinators"].items():
            if r is not None:
                series.setdefault(name, []).append({"at_s": sample["at_s"], **r})
    return series


def flat_checks(samples: list[dict[str, Any]], from_s: float = FLAT_FROM_S) -> dict[str, dict[str, Flatness]]:
    """Per coordinator: RSS and the descriptors it holds, flat from minute 5 to the end (resources.py);
    raw open files and the heap's parts beside them, reported without a verdict of their own."""
    out: dict[str, dict[str, Flatness]] = {}
    for name, series in coordinator_series(samples).items():
        keys = (*FLAT_KEYS, "fds_held", "node_connections", "python_blocks", "malloc_in_use_kib", "malloc_free_kib")
        out[name] = {key: flatness(series, key, from_s) for key in keys}
    return out


def stayed_flat(report: dict[str, Any]) -> bool:
    """No coordinator's RSS or open files grew past the limit (a run shorter than the warm-up: no verdict)."""
    checks = report["flat"]["coordinators"].values()
    return all(per[key]["flat"] is not False for per in checks for key in FLAT_KEYS)


def start_end(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Each coordinator at start and end; nodes whose process lived through the whole run (same PID)."""
    first, last = samples[0], samples[-1]
    same = {
        name: {"start": r, "end": last["nodes"][name]}
        for name, r in first["nodes"].items()
        if r and last["nodes"].get(name) and last["nodes"][name]["pid"] == r["pid"]
    }
    out: dict[str, Any] = {
        "coordinators": {
            name: {"start": first["coordinators"].get(name), "end": last["coordinators"].get(name)}
            for name in first["coordinators"]
        }
    }
    out["nodes_never_restarted"] = same
    if same:
        out["node_rss_kib_total"] = {
            "start": sum(v["start"]["rss_kib"] for v in same.values()),
            "end": sum(v["end"]["rss_kib"] for v in same.values()),
        }
        out["node_fds_total"] = {
            "start": sum(v["start"]["fds"] for v in same.values()),
            "end": sum(v["end"]["fds"] for v in same.values()),
        }
    return out


def _fault_counts(events: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in events:
        key = e["kind"] if e["kind"] != "rogue" else f"rogue-{e['mode']}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def render_soak(report: dict[str, Any]) -> str:
    res = report["resources"]["start_end"]
    lines = [
        f"layerswarm chaos --soak: {report['duration_s']} s, {report['sent']} requests, {report['ok']} answered 200, "
        f"{report['clear_errors']} clear errors {report['clear_error_codes'] or ''}, {report['lost']} lost",
        f"  non-200 while the minimum depth was reachable: {report['non_200_while_min_depth_reachable']}",
        f"  faults: {report['faults']}",
        f"  forging device: {report['forging_device']}",
    ]
    for name, ends in res["coordinators"].items():
        lines.append(
            f"  {name}: RSS {_kib(ends['start'])} -> {_kib(ends['end'])} MiB, open files "
            f"{_fds(ends['start'])} -> {_fds(ends['end'])}"
        )
        for check in report["flat"]["coordinators"].get(name, {}).values():
            lines.append(f"    {_flat_line(check)}")
    errors = report.get("coordinator_errors") or []
    lines.append(f"  coordinator error and traceback lines: {len(errors)}")
    lines += [f"    {line.rstrip()}" for line in errors[:60]]
    if "node_rss_kib_total" in res:
        rss, fds = res["node_rss_kib_total"], res["node_fds_total"]
        lines.append(
            f"  {len(res['nodes_never_restarted'])} nodes never restarted: RSS total {rss['start'] / 1024:.1f} -> "
            f"{rss['end'] / 1024:.1f} MiB, open files {fds['start']} -> {fds['end']}"
        )
    return "\n".join(lines)


def _flat_line(check: Flatness) -> str:
    if check["flat"] is None:
        return f"{check['key']}: no sample at or after the warm-up"
    verdict = ("flat" if check["flat"] else "NOT flat") if check["key"] in FLAT_KEYS else "(reported)"
    return (
        f"{check['key']}: {check['baseline']} at {check['from_s']} s, max {check['max']} "
        f"({check['max_drift_pct']:+.2f}%), end {check['end']} ({check['end_drift_pct']:+.2f}%) {verdict}"
    )


def _kib(r: dict[str, Any] | None) -> str:
    return "-" if r is None else f"{r['rss_kib'] / 1024:.1f}"


def _fds(r: dict[str, Any] | None) -> str:
    return "-" if r is None else str(r["fds"])
