"""The chaos report: what was sent, answered, refused with a reason, and lost; latency and accuracy
with and without faults; how fast the coordinator routed around faults and re-admitted recoveries."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from collections import Counter
from dataclasses import asdict
from typing import Any

from layerswarm.wire.stats import quantile

from .load import Record


def summarize(
    records: list[Record],
    events: list[dict[str, Any]],
    depth_timeline: list[tuple[float, int]],
    min_blocks: int,
    deadline_s: float,
) -> dict[str, Any]:
    for event in events:  # what the requests in flight during each fault saw
        during = [r for r in records if _during_fault(r, [event])]
        event["requests_during"] = len(during)
        event["ok_during"] = sum(r.status == 200 for r in during)
    faulted = [r for r in records if _during_fault(r, events)]
    calm = [r for r in records if not _during_fault(r, events)]
    answered = [r for r in records if r.status is not None]
    clear = [r for r in answered if _clear_error(r)]
    lost = [r for r in records if r.status is None or (r.status >= 500 and not _clear_error(r))]
    # A refusal is excused only if the depth fell below the minimum at some point while it was in flight.
    refused_while_reachable = [
        r for r in clear if _min_depth(r.sent, r.sent + r.latency_s, depth_timeline) >= min_blocks
    ]
    return {
        "sent": len(records),
        "ok": sum(r.status == 200 for r in records),
        "clear_errors": len(clear),
        "clear_error_codes": _counts(f"{r.status} {r.error}" for r in clear),
        "lost": len(lost),
        "lost_examples": [asdict(r) for r in lost[:5]],
        "non_200_while_min_depth_reachable": len(refused_while_reachable),
        "non_200_while_min_depth_reachable_examples": [
            {**asdict(r), "at_s": round(r.sent - records[0].sent, 3)} for r in refused_while_reachable[:5]
        ],
        "requests_during_faults": len(faulted),
        "latency_ms": {"without_faults": _percentiles(calm), "with_faults": _percentiles(faulted)},
        "max_latency_ms": round(max((r.latency_s for r in answered), default=0.0) * 1e3, 1),
        "deadline_budget_ms": round(deadline_s * 1e3, 1),
        "accuracy": {"without_faults": _accuracy(calm), "with_faults": _accuracy(faulted)},
        "hops": dict(sum((Counter(r.hops) for r in records), Counter())),
        "connect_retries": sum(r.connect_retries for r in records),
        "faults": events,
    }


def environment() -> dict[str, Any]:
    """Where and when a run happened, and how busy the machine was (other work shares its cores)."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()} {_cpu_model()}",
        "cpus": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        return ""


def _clear_error(r: Record) -> bool:
    return r.status is not None and (400 <= r.status < 500 or (r.status == 503 and r.error == "insufficient_depth"))


def _during_fault(r: Record, events: list[dict[str, Any]]) -> bool:
    end = r.sent + r.latency_s
    return any(e["at"] <= end and r.sent <= (e["recovered_at"] or float("inf")) for e in events)


def _min_depth(start: float, end: float, timeline: list[tuple[float, int]]) -> int:
    before = [d for at, d in timeline if at <= start]
    during = [d for at, d in timeline if start < at <= end]
    return min([*before[-1:], *during], default=0)


def _percentiles(records: list[Record]) -> dict[str, float | None]:
    latencies = sorted(r.latency_s * 1e3 for r in records if r.status == 200)
    if not latencies:
        return {"p50": None, "p99": None, "n": 0}
    return {
        "p50": round(statistics.median(latencies), 1),
        "p99": round(quantile(latencies, 0.99), 1),
        "n": len(latencies),
    }


def _accuracy(records: list[Record]) -> float | None:
    ok = [r for r in records if r.status == 200]
    return round(sum(bool(r.correct) for r in ok) / len(ok), 4) if ok else None


def render(report: dict[str, Any]) -> str:
    lat, acc = report["latency_ms"], report["accuracy"]
    lines = [
        f"layerswarm chaos: {report['sent']} requests, {report['ok']} answered 200, {report['clear_errors']} clear "
        f"errors {report['clear_error_codes'] or ''}, {report['lost']} lost",
        f"  non-200 while the minimum depth was reachable: {report['non_200_while_min_depth_reachable']}",
        f"  latency without faults p50 {lat['without_faults']['p50']} ms, p99 {lat['without_faults']['p99']} ms; "
        f"with faults p50 {lat['with_faults']['p50']} ms, p99 {lat['with_faults']['p99']} ms; max "
        f"{report['max_latency_ms']} ms (budget {report['deadline_budget_ms']} ms)",
        f"  accuracy without faults {acc['without_faults']}, with faults {acc['with_faults']}",
        f"  hops: {report['hops']}; connect retries (coordinator restarting): {report['connect_retries']}",
        "",
        "| fault | target | routed around after (s) | re-admitted after (s) |",
        "| --- | --- | --- | --- |",
    ]
    for e in report["faults"]:
        lines.append(f"| {e['kind']} | {e['target']} | {_s(e.get('routed_around_s'))} | {_s(e.get('readmitted_s'))} |")
    if report.get("unavailable"):
        lines.append(f"\nnot run here: {report['unavailable']}")
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _counts(values: Any) -> dict[str, int]:
    return dict(Counter(values))
