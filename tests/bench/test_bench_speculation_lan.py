"""`python -m layerswarm.bench.speculation_lan --quick`: the speculation comparison with each node on a host
of its own behind a 100 Mbit/s link: tbf's (no delay) and the user-space switch's with a delay (network
namespaces, root). Its report is consistent with itself, and greedy speculation gave plain decoding's
tokens across the LAN too (speed is measured, not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from layerswarm.bench.speculation import member_dir

pytestmark = pytest.mark.slow


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces, tc and TAP devices")
@pytest.mark.skipif(not member_dir().is_dir(), reason="no shipped exit-aware decoder")
@pytest.mark.parametrize("delay", [None, "0.5"], ids=["tbf", "switch"])
def test_speculation_on_the_shaped_lan_reports_its_own_ratios(tmp_path: Path, delay: str | None) -> None:
    out = tmp_path / "lan.json"
    cmd = [sys.executable, "-m", "layerswarm.bench.speculation_lan", "--quick", "--json", str(out)]
    cmd += [] if delay is None else ["--delay-ms", delay]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "skipped" not in report, report
    assert report["link_mbit"] == 100 and report.get("one_way_delay_ms") == (None if delay is None else 0.5)
    assert report["identical_to_plain"] is True
    modes = report["modes"]
    for m in modes.values():
        assert m["over_plain"] == pytest.approx(m["tokens_per_s"] / modes["plain"]["tokens_per_s"], rel=1e-2)
    assert modes["k=4"]["trips_per_token"] < 1.0 <= modes["plain"]["trips_per_token"]


def test_a_delay_out_of_range_is_refused_naming_the_flag() -> None:
    cmd = [sys.executable, "-m", "layerswarm.bench.speculation_lan", "--delay-ms", "500"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--delay-ms" in done.stderr and "Traceback" not in done.stderr
