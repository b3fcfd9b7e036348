"""No single point of failure (issue 43), the short CI variant of `layerswarm chaos --quick --coordinators 2`:
two coordinators, each told of the other, on a token-protected swarm with rogue nodes and the usual node
faults; the load through the Python client with both URLs (one attempt per coordinator per request),
one worker's through HAProxy in front of both (where installed); each coordinator SIGKILLed and
restarted in turn. Each test fails when its part is removed: a client
that does not fail over (lost requests, 5xx), a kill cycle that skips one or kills the next before the
last is back, a retry sent to the same coordinator, a coordinator that keeps routing through a liar the
other convicted."""

from __future__ import annotations

import itertools
import shutil
from typing import Any

import pytest

from layerswarm.chaos.attack import quick_options, run_attack
from layerswarm.chaos.coordinators import AVOID_WITHIN
from layerswarm.cli import build_parser
from layerswarm.cli.chaos import run_from_args
from layerswarm.harness.netlab import NetLab
from layerswarm.harness.netns import in_private_netns


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    reason = NetLab.available()
    if reason or not in_private_netns():
        pytest.skip(reason or "needs a private network namespace")
    return run_attack(quick_options(seed=2, coordinators=2))


@pytest.mark.slow
@pytest.mark.netns
def test_clients_fail_over_and_see_no_5xx_and_no_loss(report: dict[str, Any]) -> None:
    section = report["coordinators"]
    clients = section["clients"]
    assert report["lost"] == 0, report["lost_examples"]
    assert clients["http_5xx"] == 0 and clients["no_answer"] == 0
    assert clients["same_coordinator_retries"] == 0  # one attempt per coordinator: failover only
    assert clients["requests_failed_over"] > 0  # the kills were seen by clients, and bridged by the other
    assert all(count > 0 for count in clients["served_by"].values())  # both served
    balanced = clients["through_balancer"]  # one URL, one attempt: HAProxy's own checks and re-dispatch
    if shutil.which("haproxy"):
        assert balanced["sent"] > 0 and balanced["ok"] == balanced["sent"], balanced


@pytest.mark.slow
@pytest.mark.netns
def test_every_coordinator_is_killed_and_back_one_at_a_time(report: dict[str, Any]) -> None:
    kills = report["coordinators"]["kills"]
    assert [k["coordinator"] for k in kills] == [1, 2]
    assert all(k["killed_pid"] != k["restarted_pid"] for k in kills)
    for before, after in itertools.pairwise(kills):
        assert before["ready_at_s"] is not None and before["ready_at_s"] <= after["killed_at_s"]  # never both down
    assert kills[-1]["ready_at_s"] is not None
    assert not any(row["target"].startswith("every coordinator") and not row["pass"] for row in report["checks"])


@pytest.mark.slow
@pytest.mark.netns
def test_a_liar_convicted_by_one_is_avoided_by_the_other_within_5_requests(report: dict[str, Any]) -> None:
    section = report["coordinators"]
    liars = section["liars"]
    assert liars and all(liar["first"] is not None for liar in liars), liars
    for liar in liars:
        for url, other in liar["others"].items():
            assert other["requests_through_liar"] <= AVOID_WITHIN, (liar["target"], url, other)
    assert sum(section["tips_acted"].values()) > 0  # the convictions were told to the other coordinator


def test_several_coordinators_need_the_attack_run() -> None:
    for extra in ("--basic", "--soak"):
        args = build_parser().parse_args(["chaos", extra, "--coordinators", "2"])
        assert run_from_args(args) == 2
