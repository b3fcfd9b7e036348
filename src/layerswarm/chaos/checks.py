"""The targets of issue 9's attack run, checked against a chaos report: one row per target with what
was measured and pass/fail, so a reader (and the exit status) sees every miss and by how much."""

from __future__ import annotations

from typing import Any


def _row(target: str, measured: Any, ok: bool) -> dict[str, Any]:
    return {"target": target, "measured": measured, "pass": bool(ok)}


def attack_checks(report: dict[str, Any], opts: Any) -> list[dict[str, Any]]:
    rows = [
        _row("0 lost", report["lost"], report["lost"] == 0),
        _row(
            "every request 200 while the minimum depth is reachable (coordinator restart included)",
            f"{report['non_200_while_min_depth_reachable']} non-200",
            report["non_200_while_min_depth_reachable"] == 0,
        ),
        _row(f"at least {opts.requests} requests", report["sent"], report["sent"] >= opts.requests),
        _row(
            "half of the nodes faulted at some point",
            f"{report['nodes_faulted']} of {report['nodes']}",
            2 * report["nodes_faulted"] >= report["nodes"],
        ),
        _row("at least two rogue nodes", len(report["rogues"]), len(report["rogues"]) >= 2),
    ]
    for rogue in report["rogues"]:
        seconds, requests = rogue["detected_after_s"], rogue["detected_after_requests"]
        rows.append(
            _row(
                f"rogue {rogue['mode']} ({rogue['target']}) detected",
                "never" if seconds is None else f"after {seconds} s, {requests} requests",
                seconds is not None,
            )
        )
    base, after = report["baseline"]["accuracy"], report["after_detection"]["accuracy"]
    rows.append(
        _row(
            "accuracy after detection within 1 point of the no-fault run",
            f"{after} vs {base} ({report['after_detection']['requests']} vs {report['baseline']['requests']} requests)",
            after is not None and base is not None and base - after <= 0.01,
        )
    )
    p99_base = report["baseline"]["p99_ms"]
    p99_faults = report["latency_ms"]["with_faults"]["p99"]
    budget = None if p99_base is None else p99_base + report["hop_deadline_ms"]
    rows.append(
        _row(
            "p99 with faults <= no-fault p99 + one hop deadline",
            f"{p99_faults} ms vs {p99_base} + {report['hop_deadline_ms']:.0f} = {budget} ms",
            p99_faults is not None and budget is not None and p99_faults <= budget,
        )
    )
    rows += _forging_rows(report["forging_device"])
    return rows


def _forging_rows(forging: dict[str, Any]) -> list[dict[str, Any]]:
    attacks = forging["attacks"]
    forged = [a for a in attacks if a["kind"] == "forge"]
    steals = [a for a in attacks if a["kind"] == "steal"]
    flipped = sorted({n for a in forged for n in a["real_nodes_flipped"]})
    goodbyes = sum(a.get("goodbyes", 0) for a in forged)
    rows = [
        _row(
            "forged goodbyes and foreign adverts remove or flip no real node",
            f"{goodbyes} goodbyes, {sum(a.get('foreign_adverts', 0) for a in forged)} adverts; flipped: {flipped}",
            bool(forged) and goodbyes > 0 and not flipped,
        )
    ]
    captured = sorted({m for a in steals for m in a["methods_captured"]})
    replays = sum(a.get("replays", 0) for a in steals)
    accepted = sum(a.get("replays_accepted", 0) for a in steals)
    rows.append(
        _row(
            "token theft: the impostor is sent no secret and no work; every replay refused",
            f"calls captured {captured}, token seen: {forging['token_seen']}, replays {replays}, accepted {accepted}",
            bool(steals) and captured == ["Info"] and not forging["token_seen"] and replays > 0 and accepted == 0,
        )
    )
    return rows


def render_checks(rows: list[dict[str, Any]]) -> str:
    lines = ["| target | measured | result |", "| --- | --- | --- |"]
    lines += [f"| {r['target']} | {r['measured']} | {'pass' if r['pass'] else 'FAIL'} |" for r in rows]
    return "\n".join(lines)
