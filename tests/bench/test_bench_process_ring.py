"""bench/process_ring.py: the ring really runs every block, in order, in its own process (its output
must equal the one-process loop's bit for bit, or the run raises), and reports both timings."""

from __future__ import annotations

from pathlib import Path

from layerswarm.bench.process_ring import run


def test_the_ring_computes_what_the_loop_computes(model_dir: Path) -> None:
    report = run(model_dir, reps=2)
    assert report["blocks"] == 3 and report["reps"] == 2
    for key in ("monolith_blocks_ms", "ring_first_ms", "ring_again_ms"):
        assert report[key] > 0
    # The times are rounded to the microsecond and the ratio to 3 places: the reported ratio must
    # lie within what those roundings allow (a short ring's 0.4 ms moves the ratio by 0.002).
    first, mono, half = report["ring_first_ms"], report["monolith_blocks_ms"], 0.0005
    low, high = (first - half) / (mono + half), (first + half) / (mono - half)
    assert low - half <= report["ring_first_over_monolith"] <= high + half
