"""`layerswarm bench --only generation --quick`: real node processes and a coordinator on the shipped decoder;
the report names the machine and its ratios are the ones its own figures give (speed is measured, not
asserted)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from layerswarm.models.zoo import family_root

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not (family_root("lm") / "layershuffle-0").is_dir(), reason="no shipped decoder")
def test_generation_suite_reports_ratios_against_its_own_baselines(tmp_path: Path) -> None:
    out, md = tmp_path / "gen.json", tmp_path / "gen.md"
    cmd = [sys.executable, "-m", "layerswarm", "bench", "--only", "generation", "--quick"]
    result = subprocess.run(
        [*cmd, "--json", str(out), "--markdown", str(md)], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["cores"] >= 1 and report["environment"]["processor"]
    g = report["generation"]
    parts = g["floor_parts_ms"]
    assert g["floor_ms"] == pytest.approx(g["depth"] * parts["echo_round_trip"] + parts["monolith_per_token"], rel=1e-3)
    assert g["batch1_over_floor"] == pytest.approx(g["batch1_per_token_ms"] / g["floor_ms"], rel=1e-2)
    by_round = g["floor_parts_by_round_ms"]  # the floor timed in every round, beside the swarm
    assert len(by_round["echo_round_trip"]) == len(by_round["monolith_per_token"]) == g["rounds"]
    echoes, monoliths = by_round["echo_round_trip"], by_round["monolith_per_token"]
    floors = [g["depth"] * e + m for e, m in zip(echoes, monoliths, strict=True)]
    assert g["floor_ms_range"] == pytest.approx([min(floors), max(floors)], abs=2e-3)
    assert parts["echo_round_trip"] == pytest.approx(statistics.median(by_round["echo_round_trip"]), abs=1e-3)
    assert g["tokens_per_s_1_stream"] > 0 and g["tokens_per_s_16_streams"] > 0  # streams really produced tokens
    assert g["streams_16_over_1"] == pytest.approx(g["tokens_per_s_16_streams"] / g["tokens_per_s_1_stream"], rel=1e-2)
    cpu, ceiling = g["swarm_cpu_ms_per_token"], g["cpu_ceiling_16_streams"]
    assert cpu["1_stream"] > 0 and cpu["16_streams"] > 0  # the swarm's processes really were counted
    coordinator = cpu["16_streams_coordinator"]  # the coordinator's share: more than a node's on average
    assert 0 < coordinator < cpu["16_streams"] and coordinator > (cpu["16_streams"] - coordinator) / g["depth"]
    assert ceiling["tokens_per_s"] == pytest.approx(ceiling["cores"] * 1e3 / cpu["16_streams"], rel=1e-2)
    assert ceiling["over_1_stream"] == pytest.approx(ceiling["tokens_per_s"] / g["tokens_per_s_1_stream"], rel=1e-2)
    assert g["tokens_per_s_16_streams"] <= ceiling["tokens_per_s"] * 1.05  # CPU bounds what was measured
    need = ceiling["cpu_ms_per_token_for_target"]  # 2 cores / (8 x one stream's tokens/s)
    assert need["one_stream_as_measured"] == pytest.approx(
        ceiling["cores"] * 1e3 / (8 * g["tokens_per_s_1_stream"]), rel=1e-2
    )
    faster = g["batch1_per_token_ms"] / (1.5 * g["floor_ms"])  # a lone stream this much faster at the target
    assert need["one_stream_at_batch1_target"] == pytest.approx(need["one_stream_as_measured"] / faster, rel=1e-2)
    spec = g["speculation"]
    assert spec["identical_to_plain"] is True  # greedy speculation gave plain decoding's tokens
    modes = spec["modes"]
    assert set(modes) == {"plain", "k=2", "k=4", "auto"}
    assert 1.0 <= modes["plain"]["trips_per_token"] < 1.1  # one a token (and one for a stream's end token)
    for m in modes.values():
        assert m["over_plain"] == pytest.approx(m["tokens_per_s"] / modes["plain"]["tokens_per_s"], rel=1e-2)
    assert modes["k=4"]["trips_per_token"] < 1.0 and 0 < modes["k=4"]["acceptance"] <= 1
    assert "Generation through a swarm" in md.read_text() and "Self-speculative decoding" in md.read_text()
