"""`layerswarm up`, the README's main job, end to end on the shipped weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from layerswarm.harness.netns import in_private_netns, loopback_multicast_ready
from layerswarm.harness.swarm import node_layout
from layerswarm.models.zoo import family_root, model_dirs

pytestmark = pytest.mark.slow


def test_layout_puts_several_models_behind_every_block() -> None:
    members = [p for p, _ in model_dirs(family_root())][:3]
    layout = node_layout(members, depth=4, count=10)
    assert [b for _, b in layout] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert {m for m, b in layout if b == 0} == set(members)


def test_victims_leave_every_block_index_but_one_a_node() -> None:
    """`--kill` past that is cut to it (and `up` says so): one index goes entirely, forcing a cross-block
    substitution or a skip, and the demo's minimum depth (depth - 1) still holds."""
    import random
    from types import SimpleNamespace

    from layerswarm.cli.swarm_demo import choose_victims

    nodes = [SimpleNamespace(ready={"block": b}, name=i) for i, b in enumerate([0, 1, 2, 3, 0, 1, 2, 3, 0])]
    for asked in (1, 3, 5, 8):
        victims = choose_victims(nodes, asked, random.Random(asked))
        assert len(victims) == min(asked, 9 - 3)  # at most all of one index and all but one of the others
        left = {n.ready["block"] for n in nodes if n not in victims}
        assert len(left) >= 3 and len(victims) == len({id(v) for v in victims})


def test_spread_victims_leave_every_block_index_a_node() -> None:
    """--victims spread: every loss is a rebuild on another replica, never a skip."""
    import random
    from types import SimpleNamespace

    from layerswarm.cli.swarm_demo import choose_victims

    nodes = [SimpleNamespace(ready={"block": b}, name=i) for i, b in enumerate([0, 1, 2, 3, 0, 1, 2, 3, 0])]
    for asked in (1, 3, 5, 8):
        victims = choose_victims(nodes, asked, random.Random(asked), "spread")
        assert len(victims) == min(asked, 9 - 4)  # all but one node of every index at most
        assert {n.ready["block"] for n in nodes if n not in victims} == {0, 1, 2, 3}


def test_up_states_the_block_rule_it_runs_under() -> None:
    """The coordinator's rule (assembly.depth_rule), with where each number came from: `up`'s own
    --min-blocks and what a coordinator started by hand on the same model would need instead."""
    from layerswarm.cli.swarm_demo import block_rule, demo_min_blocks, family_members

    members, depth = family_members(family_root())
    line = block_rule(members[0], demo_min_blocks(depth))
    assert f"answered while {depth - 1} of {depth} block indices are reachable (--min-blocks; 1 may be down" in line
    assert f"`up` passes --min-blocks {depth - 1}" in line
    assert f"without --min-blocks needs {depth} of {depth} (the evaluated minimum useful depth" in line


@pytest.mark.parametrize("network", ["loopback", "netns"])
def test_up_survives_killed_nodes(network: str) -> None:
    if network == "netns" and not (in_private_netns() and loopback_multicast_ready()):
        pytest.skip("mDNS variant runs inside the private namespace scripts/test makes")
    cmd = [sys.executable, "-m", "layerswarm", "up", "--json", "--requests", "12", "--network", network]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert "layerswarm up: block rule: a request is answered while" in result.stderr
    assert summary["block_rule"]["rule"] in result.stderr  # what `up` printed is what the coordinator runs
    for key in (
        "requests",
        "succeeded",
        "failed",
        "accuracy",
        "nodes_started",
        "nodes_killed",
        "substituted_hops",
        "skipped_hops",
    ):
        assert key in summary
    assert summary["requests"] == 24 and summary["succeeded"] == 24 and summary["failed"] == 0
    assert summary["nodes_killed"] >= 1 and summary["nodes_started"] > summary["nodes_killed"]
    (after,) = (phase for name, phase in summary["phases"].items() if name != "all nodes up")
    assert after["substituted_hops"] + after["skipped_hops"] > 0  # the kills were routed around, not missed
    assert summary["accuracy"] > 0.5  # well above chance (0.1) even with a third of the swarm dead
    # blocks per request and the exits, per phase: what the default exit rule did
    for phase in summary["phases"].values():
        blocks = phase["blocks_per_request"]
        assert len(blocks) == 12 and all(1 <= b <= summary["depth"] for b in blocks)
        assert phase["mean_blocks"] == round(sum(blocks) / 12, 3)
        assert phase["exited_early"] <= sum(b < summary["depth"] for b in blocks)  # after kills, skips too
    before = summary["phases"]["all nodes up"]  # every node up: a shorter path is an exit, nothing else
    assert before["exited_early"] == sum(b < summary["depth"] for b in before["blocks_per_request"])
    assert summary["exited_early"] > 0  # the shipped family exits early by default (issue 42)


def test_the_summary_shows_blocks_per_request_and_the_exits() -> None:
    """What `up` prints (and --json holds): per phase the blocks each answered request ran, their mean, and
    how many the exit rule stopped early; a failed request ran none and is not counted."""
    from layerswarm.cli.up import Phase, render, summarise

    def row(blocks: int, exited: bool) -> dict[str, object]:
        return {
            "status": 200,
            "correct": True,
            "blocks": blocks,
            "exited_early": exited,
            "substituted": 0,
            "skipped": 0,
        }

    before = Phase("all nodes up", [row(8, False), row(4, True), row(8, False)])
    after = Phase("1 node killed", [row(3, True), {"status": 503, "correct": False}])
    summary = {**summarise([before, after], [], [], {}), "depth": 8}
    assert summary["phases"]["all nodes up"]["blocks_per_request"] == [8, 4, 8]
    assert summary["phases"]["all nodes up"]["mean_blocks"] == round(20 / 3, 3)
    assert summary["phases"]["1 node killed"]["exited_early"] == 1 and summary["exited_early"] == 2
    assert summary["mean_blocks"] == 5.75  # (8 + 4 + 8 + 3) / 4 answered
    text = render(summary)
    assert "blocks/req" in text.splitlines()[2] and "exited" in text.splitlines()[2]
    assert "  all nodes up: 8 blocks x 2, 4 x 1" in text and "  1 node killed: 3 blocks x 1" in text
