"""`layerswarm up --family lm`, the real command: a node process per block of the shipped decoder family,
a coordinator, concurrent completions streamed over the OpenAI-compatible API, a third of the nodes
SIGKILLed while streams are in flight, and every stream ending with [DONE]."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from layerswarm.models.zoo import family_root

pytestmark = pytest.mark.slow
FAMILY = family_root("lm")


@pytest.mark.skipif(not FAMILY.is_dir(), reason="no shipped language-model family")
def test_up_lm_streams_finish_through_killed_nodes() -> None:
    """With speculation on (the coordinator drafts, each verify is a multi-token step), as issue 41 asks:
    the failover paths are the same for plain streams (tests/coordinator/test_generation_swarm.py)."""
    cmd = [sys.executable, "-m", "layerswarm", "up", "--family", "lm", "--json", "--streams", "8"]
    cmd += ["--speculation", "auto"]
    cmd += ["--network", "loopback"]  # static peers: the failover, not discovery, is this test's subject
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["streams"] == 16 and summary["done"] == 16 and summary["failed"] == 0, summary["errors"]
    assert summary["nodes_killed"] == summary["nodes_started"] // 3 >= 1
    before, after = summary["phases"].values()
    assert before["rebuilt_hops"] == before["skipped_hops"] == 0  # nothing to route around yet
    assert after["in_flight_at_kill"] >= 1  # the kill landed mid-stream, not between phases
    assert after["rebuilt_hops"] + after["skipped_hops"] >= 1  # and the streams went around it
    assert sum(summary["coordinator_failovers"].values()) >= 1
    assert before["exact_match"] >= 0.5  # the family answers its task through the swarm (0.85 measured)
    assert summary["speculation"] == "auto" and summary["drafted"] > 0 and summary["accepted"] > 0
