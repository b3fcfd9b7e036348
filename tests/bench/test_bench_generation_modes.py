"""`layerswarm bench --only generation-modes --quick`: plain decoding, speculation and early exit through one
swarm of the shipped exit-aware decoder; the report's ratios are the ones its own figures give, lossless
modes give plain decoding's tokens, and early exit really leaves the route (speed is measured, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from layerswarm.models.zoo import family_root

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not (family_root("lm") / "layershuffle-exit-0").is_dir(), reason="no shipped decoder")
def test_generation_modes_suite_compares_the_modes_on_the_same_prompts(tmp_path: Path) -> None:
    out = tmp_path / "modes.json"
    cmd = [sys.executable, "-m", "layerswarm", "bench", "--only", "generation-modes", "--quick", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["cores"] >= 1 and report["environment"]["processor"]
    g = report["generation_modes"]
    depth, task, text = g["depth"], g["task"], g["text"]
    assert set(task) == set(text) == {"plain", "speculation k=2", "speculation auto", "early exit (calibrated)"}
    assert task["plain"]["block_hops_per_token"] == text["plain"]["block_hops_per_token"] == depth
    for mode in ("speculation k=2", "speculation auto"):  # lossless: plain decoding's tokens, fewer trips
        assert task[mode]["same_as_plain"] == text[mode]["same_as_plain"] == 1.0
        assert text[mode]["trips_per_token"] < 1.0
    exit_row = task["early exit (calibrated)"]
    assert exit_row["exits"] > 0 and exit_row["block_hops_per_token"] < depth
    assert exit_row["fewer_block_hops"] == pytest.approx(depth / exit_row["block_hops_per_token"], rel=1e-2)
    assert exit_row["em_loss_points"] == pytest.approx(
        100 * (task["plain"]["exact_match"] - exit_row["exact_match"]), abs=0.01
    )
