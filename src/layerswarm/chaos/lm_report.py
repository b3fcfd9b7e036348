"""The generation chaos run's report: both phases' streams, the faults (and the streams mid-way when each
landed), the liars (when convicted, which streams they touched, which were rebuilt past them), and a
verdict table (target, measured, pass) in checks.py's form: the exit status is 0 only if every row passes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from layerswarm.harness.streams import Task, labelled_counter

from .checks import render_checks
from .lm_load import StreamRecord

EM_POINTS = 0.02  # exact match within 2 points of the no-fault run...
EM_MIN_COMPARED = 50  # ...or, with fewer streams compared than this, within one stream
LIAR_KINDS = ("turncoat", "liar")  # redeployed to lie until the end (lm_run.py): never re-admitted


class Schedule(Protocol):
    events: list[dict[str, Any]]
    liars: list[dict[str, Any]]

    def convicted_at(self) -> float | None: ...


class Timeline(Protocol):
    timeline: list[tuple[float, dict[str, str]]]


def lm_report(
    no_faults: list[StreamRecord],
    with_faults: list[StreamRecord],
    tasks: Sequence[Task],
    schedule: Schedule,
    poller: Timeline,
    view: dict[str, Any],
    metrics: str,
    opts: Any,
) -> dict[str, Any]:
    base = {r.prompt: r.result for r in no_faults}
    t0 = with_faults[0].sent if with_faults else 0.0
    caught = schedule.convicted_at()
    after = [r for r in with_faults if caught is not None and r.sent >= caught]
    convictions = {n["address"]: int(n.get("convictions", 0)) for n in view.get("nodes", [])}
    liar_addresses = {liar["address"] for liar in schedule.liars}
    report: dict[str, Any] = {
        "family": "lm",
        "prompts": len(tasks),
        "no_faults": tally(no_faults),
        "with_faults": {**tally(with_faults), **against_no_faults(with_faults, base)},
        "after_detection": {
            "from_s": None if caught is None else round(caught - t0, 3),
            **tally(after),
            **against_no_faults(after, base),
        },
        "faults": [fault_view(e, with_faults, poller.timeline, t0) for e in schedule.events],
        "liars": [liar_view(liar, with_faults, base, convictions, t0) for liar in schedule.liars],
        "honest_convicted": sorted(a for a, c in convictions.items() if c > 0 and a not in liar_addresses),
        "node_states_after": dict(Counter(n["state"] for n in view.get("nodes", []))),
        "coordinator": {
            "failovers": labelled_counter(metrics, "layerswarm_gen_failovers", "kind"),
            "streams": labelled_counter(metrics, "layerswarm_gen_streams", "outcome"),
            "convictions": labelled_counter(metrics, "layerswarm_verify_convictions", "").get("", 0.0),
        },
        "options": dict(vars(opts)),
    }
    report["checks"] = lm_checks(report, opts)
    return report


def tally(records: Sequence[StreamRecord]) -> dict[str, Any]:
    results = [r.result for r in records]
    n = len(results)
    return {
        "streams": n,
        "done": sum(s.done for s in results),
        "non_200": sum(s.status != 200 for s in results),
        "http_5xx": sum(s.status is not None and s.status >= 500 for s in results),
        "error_events": sum(s.status == 200 and not s.done and s.error is not None for s in results),
        "errors": dict(Counter(str(s.error)[:120] for s in results if not s.done)),
        "exact_match": round(sum(s.correct for s in results) / n, 4) if n else None,
        "rebuilt_hops": sum(s.rebuilt for s in results),
        "skipped_hops": sum(s.skipped for s in results),
        "streams_with_failover": sum(bool(s.rebuilt or s.skipped) for s in results),
        "convicted_in_trace": sum(bool(s.convicted) for s in results),
        "tainted_tokens": sum(s.tainted_tokens for s in results),
        "streams_tainted": sum(s.tainted_tokens > 0 for s in results),
        "p50_s": _quantile([s.elapsed_s for s in results], 0.5),
        "max_s": max((s.elapsed_s for s in results), default=None),
    }


def against_no_faults(records: Sequence[StreamRecord], base: dict[int, Any]) -> dict[str, Any]:
    """The no-fault run's exact match over the very prompts these streams asked (greedy: each prompt's
    no-fault answer is fixed), and the share whose text is the no-fault text."""
    n = len(records)
    if not n:
        return {"no_fault_exact_match_same_prompts": None, "same_text_as_no_faults": None}
    return {
        "no_fault_exact_match_same_prompts": round(sum(base[r.prompt].correct for r in records) / n, 4),
        "same_text_as_no_faults": round(sum(r.result.text == base[r.prompt].text for r in records) / n, 4),
    }


def fault_view(
    event: dict[str, Any], records: Sequence[StreamRecord], timeline: list[tuple[float, dict[str, str]]], t0: float
) -> dict[str, Any]:
    """A fault's streams mid-way and how they ended; for an honest node's fault, how long after it was
    undone every node it hit was routable again (None: not before the run ended)."""
    mid = set(event["streams_mid_way"])
    ended = [r for r in records if r.index in mid]
    return {
        "kind": event["kind"],
        "targets": event["targets"],
        "blocks": event["blocks"],
        "at_s": round(event["at"] - t0, 3),
        "recovered_at_s": None if event["recovered_at"] is None else round(event["recovered_at"] - t0, 3),
        "streams_mid_way": len(mid),
        "of_them_done": sum(r.result.done for r in ended),
        "of_them_rebuilt_or_skipped": sum(bool(r.result.rebuilt or r.result.skipped) for r in ended),
        "readmitted_after_s": None if event["kind"] in LIAR_KINDS else _readmitted(event, timeline),
    }


def _readmitted(event: dict[str, Any], timeline: list[tuple[float, dict[str, str]]]) -> float | None:
    undone = event["recovered_at"]
    if undone is None:
        return None
    back = [next((t for t, s in timeline if t >= undone and s.get(a) == "healthy"), None) for a in event["addresses"]]
    return None if None in back else round(max(t for t in back if t is not None) - undone, 3)


def liar_view(
    liar: dict[str, Any],
    records: Sequence[StreamRecord],
    base: dict[int, Any],
    convictions: dict[str, int],
    t0: float,
) -> dict[str, Any]:
    """A liar's fate, and the streams' own account of it: the ones whose trace names it (convicted, its
    position rebuilt elsewhere) and the ones that ended with it still on their route (no check caught it
    in their time: their text against the no-fault text shows whether a lie got through)."""
    address, caught = liar["address"], liar.get("convicted_at")
    named = [r for r in records if any(e.get("node") == address for e in r.result.trace)]
    convicting = [r for r in named if address in r.result.convicted]
    rebuilt = [r for r in convicting if _rebuilt_past(r, address)]
    on_route = [r for r in records if address in r.result.route and r.finished_at >= liar["at"]]
    return {
        "kind": liar["kind"],
        "mode": liar["mode"],
        "honest_replies_first": liar["honest_replies_first"],
        "target": liar["target"],
        "address": address,
        "block": liar["block"],
        "serving_from_s": round(liar["at"] - t0, 3),
        "convicted_at_s": None if caught is None else round(caught - t0, 3),
        "convicted_after_s": None if caught is None else round(caught - liar["at"], 3),
        "convictions": convictions.get(address, 0),
        "streams_naming_it": len(named),
        "streams_convicting_it": len(convicting),
        "streams_rebuilt_past_it": len(rebuilt),
        "tainted_tokens": sum(_tainted_by(r, address) for r in convicting),
        "streams_ended_with_it_on_route": len(on_route),
        "of_them_text_not_as_without_faults": sum(r.result.text != base[r.prompt].text for r in on_route),
    }


def _rebuilt_past(record: StreamRecord, address: str) -> bool:
    """Its trace convicts `address` and then rebuilds the position it held on another node."""
    trace = record.result.trace
    first = next(i for i, e in enumerate(trace) if e.get("kind") == "convicted" and e.get("node") == address)
    return any(e.get("kind") == "rebuilt" and e.get("node") == address for e in trace[first + 1 :])


def _tainted_by(record: StreamRecord, address: str) -> int:
    return sum(
        int(e.get("tainted_tokens", 0))
        for e in record.result.trace
        if e.get("kind") == "convicted" and e.get("node") == address
    )


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _row(target: str, measured: Any, ok: bool) -> dict[str, Any]:
    return {"target": target, "measured": measured, "pass": bool(ok)}


def em_tolerance(compared: int) -> float:
    return max(EM_POINTS, 1.0 / compared) if 0 < compared < EM_MIN_COMPARED else EM_POINTS


def lm_checks(report: dict[str, Any], opts: Any) -> list[dict[str, Any]]:
    calm, faulted, after = report["no_faults"], report["with_faults"], report["after_detection"]
    streams = calm["streams"] + faulted["streams"]
    done = calm["done"] + faulted["done"]
    bad = {k: calm[k] + faulted[k] for k in ("non_200", "http_5xx", "error_events")}
    rows = [
        _row(
            "every stream ended normally: [DONE], no HTTP error, no error event, none cut",
            f"{done} of {streams} [DONE] ({calm['done']}/{calm['streams']} without faults, {faulted['done']}/"
            f"{faulted['streams']} with); {bad['non_200']} non-200 ({bad['http_5xx']} 5xx), "
            f"{bad['error_events']} error events",
            streams > 0 and done == streams,
        ),
        _row(f"at least {opts.streams} streams with faults", faulted["streams"], faulted["streams"] >= opts.streams),
    ]
    for fault in report["faults"]:
        rows.append(
            _row(
                f"{fault['kind']} ({', '.join(fault['targets'])}) landed mid-stream; those streams all [DONE]",
                f"{fault['streams_mid_way']} mid-way, {fault['of_them_done']} [DONE], "
                f"{fault['of_them_rebuilt_or_skipped']} rebuilt or skipped",
                fault["streams_mid_way"] > 0 and fault["of_them_done"] == fault["streams_mid_way"],
            )
        )
    honest = [f for f in report["faults"] if f["kind"] not in LIAR_KINDS]
    rows.append(
        _row(
            "every honest node faulted routable again after the fault was undone",
            ", ".join(f"{f['kind']} {f['readmitted_after_s']} s" for f in honest),
            bool(honest) and all(f["readmitted_after_s"] is not None for f in honest),
        )
    )
    rows += _liar_rows(report)
    rows += _em_rows(report, faulted, after)
    return rows


def _liar_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [_row("at least one lying decoder node", len(report["liars"]), bool(report["liars"]))]
    for liar in report["liars"]:
        name = f"{liar['kind']} ({liar['target']}, block {liar['block']}, {liar['mode']})"
        after = liar["convicted_after_s"]
        rows.append(
            _row(
                f"{name} convicted",
                "never" if after is None else f"after {after} s serving; {liar['convictions']} conviction(s)",
                after is not None and liar["convictions"] > 0,
            )
        )
        rows.append(
            _row(
                f"{name}: a stream it touched rebuilt past it",
                f"{liar['streams_convicting_it']} streams caught it, {liar['streams_rebuilt_past_it']} rebuilt its "
                f"position on another node; {liar['tainted_tokens']} tokens drawn from its lies before",
                liar["streams_rebuilt_past_it"] > 0,
            )
        )
    honest = report["honest_convicted"]
    rows.append(_row("no honest node convicted", honest or "none", not honest))
    traced = (report["with_faults"]["rebuilt_hops"], report["with_faults"]["skipped_hops"])
    traced = (traced[0] + report["no_faults"]["rebuilt_hops"], traced[1] + report["no_faults"]["skipped_hops"])
    counted = report["coordinator"]["failovers"]
    metric = (int(counted.get("rebuilt", 0)), int(counted.get("skipped", 0)))
    rows.append(
        _row(
            "rebuilds and skips counted: the streams' traces = the coordinator's /metrics",
            f"traces: {traced[0]} rebuilt, {traced[1]} skipped; /metrics: {metric[0]} rebuilt, {metric[1]} skipped",
            traced[0] > 0 and traced == metric,
        )
    )
    return rows


def _em_rows(report: dict[str, Any], faulted: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """The verdict is on the streams that started once every liar was convicted (the kills, the freeze,
    the restart and the third of the nodes killed come after that): a lie the sampled checks let through
    before its node was caught stays in the text it reached (docs/generation-coordinator.md), so the whole
    phase's figure, those streams included, is reported beside it (exact_match_whole_phase)."""
    em, base, n = after["exact_match"], after["no_fault_exact_match_same_prompts"], after["streams"]
    tol = em_tolerance(n)
    report["exact_match_whole_phase"] = {
        "exact_match": faulted["exact_match"],
        "no_fault_same_prompts": faulted["no_fault_exact_match_same_prompts"],
        "points_lost": None
        if faulted["exact_match"] is None
        else round((faulted["no_fault_exact_match_same_prompts"] - faulted["exact_match"]) * 100, 2),
        "tokens_from_lies_in_traces": faulted["tainted_tokens"],
    }
    return [
        _row(
            f"exact match after every liar's conviction within {tol * 100:.1f} points of the no-fault run on the "
            "same prompts",
            f"{em} vs {base} ({n} streams; {after['same_text_as_no_faults']} the no-fault text)",
            em is not None and base is not None and base - em <= tol + 1e-9,
        )
    ]


def render_lm(report: dict[str, Any]) -> str:
    calm, faulted, after = report["no_faults"], report["with_faults"], report["after_detection"]
    lines = [
        f"layerswarm chaos --family lm: {report['nodes']} nodes ({', '.join(report['members'])}), "
        f"{report['prompts']} held-out task prompts, greedy streams over POST /v1/completions",
        "",
        "| phase | streams | [DONE] | exact match | same prompts, no faults | rebuilt hops | skipped hops | p50 s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        _phase_line("no faults", calm, calm["exact_match"]),
        _phase_line("with faults", faulted, faulted["no_fault_exact_match_same_prompts"]),
        _phase_line("after detection", after, after["no_fault_exact_match_same_prompts"]),
        "",
        "| fault | targets | at s | streams mid-way | of them [DONE] | routable again after s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in report["faults"]:
        lines.append(
            f"| {f['kind']} | {', '.join(f['targets'])} | {f['at_s']} | {f['streams_mid_way']} | {f['of_them_done']} "
            f"| {'-' if f['readmitted_after_s'] is None else f['readmitted_after_s']} |"
        )
    whole = report["exact_match_whole_phase"]
    lines += [
        "",
        f"whole fault phase, the turncoat's escaped lies included: exact match {whole['exact_match']} vs "
        f"{whole['no_fault_same_prompts']} without faults ({whole['points_lost']} points lost; "
        f"{whole['tokens_from_lies_in_traces']} tokens drawn from lies, as the streams' traces count them)",
        "",
        render_checks(report["checks"]),
    ]
    if report.get("coordinator_errors"):
        lines.append(f"\ncoordinator error lines: {len(report['coordinator_errors'])}")
    return "\n".join(lines)


def _phase_line(name: str, t: dict[str, Any], base: Any) -> str:
    return (
        f"| {name} | {t['streams']} | {t['done']} | {t['exact_match']} | {base} | {t['rebuilt_hops']} | "
        f"{t['skipped_hops']} | {t['p50_s']} |"
    )
