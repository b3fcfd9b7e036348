"""Generation under faults (`layerswarm chaos --family lm --quick`) through real processes: the shipped
language-model family's nodes, each its own host on a bridge, a coordinator, concurrent greedy streams
over the OpenAI endpoint, and faults mid-stream: a turncoat and a liar (lying decoder nodes), SIGKILL,
SIGSTOP, a restart, a third of the nodes SIGKILLed at once. Each test fails when its defence is gone: a
stream that does not end with [DONE] (a broken rebuild), a liar never convicted or a stream it touched
not rebuilt past it, an honest node convicted, rebuilds the metrics do not count, answers that change."""

from __future__ import annotations

from typing import Any

import pytest

from layerswarm.chaos.lm_report import render_lm
from layerswarm.chaos.lm_run import QUICK, run_lm_chaos
from layerswarm.harness.netlab import NetLab
from layerswarm.harness.netns import in_private_netns

pytestmark = [pytest.mark.slow, pytest.mark.netns]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    reason = NetLab.available()
    if reason or not in_private_netns():
        pytest.skip(reason or "needs a private network namespace")
    result = run_lm_chaos(QUICK)
    print(render_lm(result))  # shown on failure: the whole verdict table
    return result


def row(report: dict[str, Any], prefix: str) -> dict[str, Any]:
    rows = [r for r in report["checks"] if r["target"].startswith(prefix)]
    assert rows, f"no check {prefix!r} in the report"
    return rows[0]


def test_every_stream_ends_normally_through_every_fault(report: dict[str, Any]) -> None:
    assert row(report, "every stream ended normally")["pass"], report["with_faults"]["errors"]
    assert report["no_faults"]["http_5xx"] == report["with_faults"]["http_5xx"] == 0
    assert report["with_faults"]["streams"] >= QUICK.streams
    kinds = [f["kind"] for f in report["faults"]]
    assert kinds == ["turncoat", "liar", "kill", "freeze", "restart", "kill-third"]
    for fault in report["faults"]:  # each landed while streams ran, and those streams finished
        assert fault["streams_mid_way"] > 0 and fault["of_them_done"] == fault["streams_mid_way"], fault
        if fault["kind"] not in ("turncoat", "liar"):  # an honest node, back once the fault is undone
            assert fault["readmitted_after_s"] is not None, fault
    assert len(report["faults"][-1]["targets"]) == report["nodes"] // 3  # a third of the nodes at once


def test_each_liar_is_convicted_and_a_stream_it_touched_rebuilt(report: dict[str, Any]) -> None:
    assert sorted(liar["kind"] for liar in report["liars"]) == ["liar", "turncoat"]
    for liar in report["liars"]:
        assert liar["convicted_after_s"] is not None and liar["convictions"] >= 1, liar
        assert liar["streams_rebuilt_past_it"] >= 1, liar
    assert report["coordinator"]["convictions"] >= len(report["liars"])


def test_no_honest_node_is_convicted(report: dict[str, Any]) -> None:
    assert report["honest_convicted"] == []


def test_rebuilds_are_in_the_traces_and_the_metrics_alike(report: dict[str, Any]) -> None:
    assert report["with_faults"]["rebuilt_hops"] > 0
    assert row(report, "rebuilds and skips counted")["pass"], row(report, "rebuilds and skips counted")


def test_answers_after_detection_match_the_no_fault_run(report: dict[str, Any]) -> None:
    check = row(report, "exact match after every liar's conviction")
    assert check["pass"], check
    assert report["after_detection"]["streams"] >= QUICK.after_streams // 2


def test_every_verdict_passes(report: dict[str, Any]) -> None:
    failed = [r for r in report["checks"] if not r["pass"]]
    assert not failed, failed
