"""`layerswarm bench --only token-time --quick`: a token's time split by rung on the shipped decoder's swarm;
the split is the differences of its own figures, and every rung really ran (speed is not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from layerswarm.models.zoo import family_root

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not (family_root("lm") / "layershuffle-0").is_dir(), reason="no shipped decoder")
def test_token_time_splits_a_token_by_the_differences_between_rungs(tmp_path: Path) -> None:
    out = tmp_path / "tt.json"
    cmd = [sys.executable, "-m", "layerswarm", "bench", "--only", "token-time", "--quick", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    t = json.loads(out.read_text())["token_time"]
    depth, echo, hop, chain, coord = t["depth"], t["echo_ms"], t["hop"], t["chain"], t["coordinator"]
    assert echo > 0 and 0 < hop["compute_ms"] < hop["per_token_ms"]  # a hop includes its compute
    assert hop["node_cpu_ms_per_step"] > 0 and coord["nodes_cpu_ms_per_token"] > 0  # the nodes really worked
    assert chain["per_token_ms"] > hop["per_token_ms"]  # six hops take longer than one
    split = t["split"]
    assert split["grpc_round_trips"] == pytest.approx(depth * echo, abs=1e-3)
    assert split["block_compute"] == pytest.approx(depth * hop["compute_ms"], abs=1e-3)
    total = sum(v for k, v in split.items() if k != "stem_head_alone")
    assert total == pytest.approx(t["http_per_token_ms"], abs=0.01)  # the parts add up to the HTTP figure
    relay = t["relay_floor"]  # a bare chain of as many processes, beside a bare star (the route is checked)
    assert relay["hops"] == depth and relay["star_ms"] > 0 and relay["chain_ms"] > 0
    # The bounds: what a coordinator costing nothing beyond its stem and head could reach, from the rungs
    waves = t["waves"]
    assert sorted(int(g) for g in waves) == [1, 2, 4]
    for g, w in waves.items():
        assert (w["streams"], w["groups"]) == (16, int(g))
        assert w["tokens_per_s"] > 0 and w["nodes_cpu_ms_per_token"] > 0 and w["client_cpu_ms_per_token"] > 0
    assert t["monolith_ms"] > 0
    b, floor = t["bounds"], depth * echo + t["monolith_ms"]  # the echo and monolith timed beside, each round
    assert b["floor_ms"] == pytest.approx(floor, abs=1e-3)
    lean = chain["per_token_ms"] + t["stem_head_ms"] - relay["saved_ms"]
    assert b["lean_batch1_ms"] == pytest.approx(lean, abs=1e-3)
    assert b["lean_batch1_over_floor"] == pytest.approx(lean / floor, abs=1e-3)
    best = max(waves.values(), key=lambda w: w["tokens_per_s"])  # the best schedule, not always the first
    assert b["wave_groups"] == best["groups"]
    tps = best["tokens_per_s"]
    cpu = best["nodes_cpu_ms_per_token"] + best["client_cpu_ms_per_token"]
    assert b["wave_cpu_share"] == pytest.approx(tps * cpu / 1e3 / os.cpu_count(), abs=1e-3)
    assert b["wave_over_chain"] == pytest.approx(tps * chain["per_token_ms"] / 1e3, abs=0.01)
    assert b["wave_over_http_1"] == pytest.approx(tps * t["http_per_token_ms"] / 1e3, abs=0.01)
    assert b["wave_at_batch1_target"] == pytest.approx(tps * 1.5 * floor / 1e3, abs=0.01)
