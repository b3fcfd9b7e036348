"""The short CI variant of the attack run (`layerswarm chaos --quick`) and a short soak: a token-protected
swarm, every node its own host on a bridge, rogue nodes lying until the end (a turncoat and a colluding
pair among them), a forging device on its own host (forged goodbyes and foreign adverts, an impostor
that records and replays), faults on half the nodes, a coordinator restart. Each test fails when its
defence is removed: a rogue never quarantined, a forged packet that flips a real node, a secret or work
sent to the impostor, a replay accepted, a request lost. No timing is asserted; the p99 target is
checked by the full run's report only."""

from __future__ import annotations

from typing import Any

import pytest

from layerswarm.chaos.attack import quick_options, run_attack
from layerswarm.chaos.soak import SoakOptions, render_soak, run_soak
from layerswarm.harness.netlab import NetLab
from layerswarm.harness.netns import in_private_netns

pytestmark = [pytest.mark.slow, pytest.mark.netns]


def _lab_or_skip() -> None:
    reason = NetLab.available()
    if reason or not in_private_netns():
        pytest.skip(reason or "needs a private network namespace")


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    _lab_or_skip()
    return run_attack(quick_options(seed=1))


def check(report: dict[str, Any], prefix: str) -> dict[str, Any]:
    rows = [r for r in report["checks"] if r["target"].startswith(prefix)]
    assert rows, f"no check {prefix!r} in the report"
    return rows[0]


def test_nothing_is_lost_and_every_request_answered_while_reachable(report: dict[str, Any]) -> None:
    assert report["lost"] == 0, report["lost_examples"]
    assert report["non_200_while_min_depth_reachable"] == 0, report["non_200_while_min_depth_reachable_examples"]
    assert any(e["kind"] == "coordinator" for e in report["faults"])  # the restart was part of it


def test_every_rogue_is_quarantined_and_answers_stay_right(report: dict[str, Any]) -> None:
    modes = sorted(r["mode"] for r in report["rogues"])
    assert modes == ["other-block", "pair", "pair", "turncoat", "zeros"]  # the pair: both nodes of one block
    for rogue in report["rogues"]:
        assert rogue["detected_after_s"] is not None, f"rogue {rogue['mode']} never quarantined"
        assert rogue["detected_after_requests"] is not None
    after = report["after_detection"]
    assert after["requests"] > 0 and after["answered_200"] == after["requests"]
    # An undetected zeros rogue carrying half its block's hops drags accuracy far below this.
    assert after["accuracy"] is not None and after["accuracy"] >= 0.9


def test_forged_goodbyes_and_adverts_flip_no_real_node(report: dict[str, Any]) -> None:
    forged = [a for a in report["forging_device"]["attacks"] if a["kind"] == "forge"]
    assert forged and forged[0]["rc"] == 0
    assert forged[0]["goodbyes"] >= 8  # a goodbye under the real instance name of every reachable node
    assert forged[0]["real_nodes_flipped"] == [], forged[0]["flipped_to"]
    assert check(report, "forged goodbyes")["pass"]


def test_the_impostor_gets_no_secret_and_no_work_and_replays_fail(report: dict[str, Any]) -> None:
    steals = [a for a in report["forging_device"]["attacks"] if a["kind"] == "steal"]
    assert steals and steals[0]["rc"] == 0
    assert steals[0]["methods_captured"] == ["Info"]  # contacted (it was heard), never sent work
    assert report["forging_device"]["token_seen"] is False
    assert steals[0]["replays"] > 0 and steals[0]["replays_accepted"] == 0


def test_half_the_nodes_faulted_and_every_target_in_the_report(report: dict[str, Any]) -> None:
    assert 2 * report["nodes_faulted"] >= report["nodes"]
    targets = " ".join(r["target"] for r in report["checks"])
    for needed in ("0 lost", "every request 200", "rogue zeros", "accuracy after detection", "p99", "token theft"):
        assert needed in targets


def test_short_soak_reports_resources_and_loses_nothing() -> None:
    _lab_or_skip()
    # The 5-minute warm-up of a real soak shortened to 5 s: a verdict on real samples.
    opts = SoakOptions(
        duration_s=20.0, concurrency=2, seed=3, hold_s=1.0, gap_s=0.5, sample_every_s=5.0, flat_from_s=5.0
    )
    soak = run_soak(opts)
    assert soak["lost"] == 0, soak["lost_examples"]
    assert soak["non_200_while_min_depth_reachable"] == 0
    assert sum(soak["faults"].values()) >= 1
    ends = soak["resources"]["start_end"]["coordinators"]["coordinator"]
    for moment in ("start", "end"):
        coordinator = ends[moment]
        assert coordinator["rss_kib"] > 10_000 and coordinator["fds"] > 3
        assert coordinator["fds_held"] <= coordinator["fds"] and coordinator["python_blocks"] > 10_000
        assert coordinator["malloc_in_use_kib"] > 1_000 and coordinator["malloc_free_kib"] >= 0
    assert ends["start"]["pid"] == ends["end"]["pid"]  # never restarted
    assert soak["resources"]["start_end"]["nodes_never_restarted"]
    assert len(soak["resources"]["samples"]) >= 4  # start, periodic samples, end
    checks = soak["flat"]["coordinators"]["coordinator"]
    for key in (
        "rss_kib",
        "fds_held",
        "fds",
        "node_connections",
        "python_blocks",
        "malloc_in_use_kib",
        "malloc_free_kib",
    ):
        assert checks[key]["flat"] is not None and checks[key]["baseline"] > 0, checks[key]
    assert "rss_kib" in render_soak(soak) and "fds_held" in render_soak(soak)
