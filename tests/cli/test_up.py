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

    from layerswarm.cli.up import choose_victims

    nodes = [SimpleNamespace(ready={"block": b}, name=i) for i, b in enumerate([0, 1, 2, 3, 0, 1, 2, 3, 0])]
    for asked in (1, 3, 5, 8):
        victims = choose_victims(nodes, asked, random.Random(asked))
        assert len(victims) == min(asked, 9 - 3)  # at most all of one index and all but one of the others
        left = {n.ready["block"] for n in nodes if n not in victims}
        assert len(left) >= 3 and len(victims) == len({id(v) for v in victims})


@pytest.mark.parametrize("network", ["loopback", "netns"])
def test_up_survives_killed_nodes(network: str) -> None:
    if network == "netns" and not (in_private_netns() and loopback_multicast_ready()):
        pytest.skip("mDNS variant runs inside the private namespace scripts/test makes")
    cmd = [sys.executable, "-m", "layerswarm", "up", "--json", "--requests", "12", "--network", network]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
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
