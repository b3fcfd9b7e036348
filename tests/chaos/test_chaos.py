"""Failure injection, the short CI variant of `layerswarm chaos`: every node its own host on a bridge,
every fault kind once under load. One run backs one test per fault kind: each fails if the coordinator
stops routing around that fault (requests in its window not answered, or the node never left or
re-joined the routable set)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from layerswarm.chaos.run import ChaosOptions, run_chaos
from layerswarm.chaos.swarm import FAULT_KINDS, fault_tools
from layerswarm.harness.netlab import NetLab
from layerswarm.harness.netns import in_private_netns

pytestmark = [pytest.mark.slow, pytest.mark.netns]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    reason = NetLab.available()
    if reason or not in_private_netns():
        pytest.skip(reason or "needs a private network namespace")
    return run_chaos(ChaosOptions(requests=200, concurrency=4, seed=1, hold_s=1.5, warmup_s=2.0, max_s=300))


def event(report: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [e for e in report["faults"] if e["kind"] == kind]
    assert found, f"fault {kind} never ran"
    return found[0]


def test_nothing_is_lost_and_refusals_only_below_min_depth(report: dict[str, Any]) -> None:
    lost = [(e.get("index"), e.get("status"), e.get("error")) for e in report["lost_examples"]]
    assert report["sent"] >= 200 and report["lost"] == 0, lost
    assert report["non_200_while_min_depth_reachable"] == 0, report["non_200_while_min_depth_reachable_examples"]
    assert report["ok"] + report["clear_errors"] == report["sent"]
    assert set(report["clear_error_codes"]) <= {"503 insufficient_depth"}
    assert report["max_latency_ms"] <= report["deadline_budget_ms"]
    assert report["nodes_faulted"] >= 6  # up to half of the 16 nodes over one run
    assert report["accuracy"]["with_faults"] >= report["accuracy"]["without_faults"] - 0.05


@pytest.mark.parametrize("kind", ["kill", "link", "drop", "malformed"])
def test_failing_node_is_routed_around_and_readmitted(report: dict[str, Any], kind: str) -> None:
    if kind == "drop" and not fault_tools()["nftables"]:
        pytest.skip("nftables is not installed")
    e = event(report, kind)
    assert e["requests_during"] > 0 and e["ok_during"] == e["requests_during"]
    assert e["routed_around_s"] is not None, f"{kind}: the node never left the routable set"
    assert e["readmitted_s"] is not None, f"{kind}: the node was not re-admitted after recovery"


@pytest.mark.parametrize("kind", ["freeze", "slow", "restart", "join"])
def test_degraded_or_changing_node_keeps_requests_answered(report: dict[str, Any], kind: str) -> None:
    e = event(report, kind)
    assert e["requests_during"] > 0 and e["ok_during"] == e["requests_during"]
    assert e["readmitted_s"] is not None, f"{kind}: the node did not come back (or join) as healthy"


def test_slow_and_frozen_hops_are_hedged(report: dict[str, Any]) -> None:
    assert report["hops"].get("hedged", 0) > 0


def test_coordinator_restart_comes_back_and_rediscovers(report: dict[str, Any]) -> None:
    e = event(report, "coordinator")
    assert e["readmitted_s"] is not None, "the restarted coordinator never reached the minimum depth again"
    assert report["connect_retries"] > 0  # clients saw it down, and got answers after it came back


def test_every_available_fault_kind_ran(report: dict[str, Any]) -> None:
    tools = fault_tools()
    expected = {k for k in FAULT_KINDS if (k != "drop" or tools["nftables"]) and (k != "netem" or tools["netem"])}
    assert {e["kind"] for e in report["faults"]} == expected


def test_the_run_leaves_no_peer_memory_where_a_users_coordinator_reads_it(report: dict[str, Any]) -> None:
    """The lab's coordinator listens on 8080, the port a user's own coordinator defaults to: before, a
    chaos run without a token wrote its lab addresses (198.18.x) into the default peer memory for
    8080, and the user's next coordinator on that port dialled them out of a real interface. (The
    tests keep every default state file in a folder of their own: conftest.py.)"""
    assert report["faults"]  # the run happened
    assert not list(Path(os.environ["LAYERSWARM_STATE_DIR"]).glob("coordinator-*.json"))
