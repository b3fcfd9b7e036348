"""A request that sets only `deadline_ms` gets an anytime answer from a default coordinator: cut by the
budget no earlier than the shipped member's calibrated floor, and never cut when the budget is ample."""

from __future__ import annotations

import asyncio

import pytest

from layerswarm.bench import anytime_default
from layerswarm.models.zoo import family_root, robust_members


def test_a_deadline_alone_cuts_answers_at_the_calibrated_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(anytime_default, "FRACTIONS", (0.05, 20.0, None))
    monkeypatch.setattr(anytime_default, "CALIBRATION", 3)
    member = robust_members(family_root("shapes"))[0]
    report = asyncio.run(anytime_default.run([("shapes", member)], 6))["families"]["shapes"]
    floor = report["depth_rule"]["anytime_min_blocks"]
    assert 1 < floor < report["depth_rule"]["depth"]  # calibrated, not the readiness minimum of 8
    tight, ample, unbounded = report["curve"]
    # a twentieth of the full path's latency: every answer that did not exit early is cut, at the floor
    assert tight["cut_by_deadline"] + tight["exited_early"] == pytest.approx(1.0)
    assert tight["fewest_blocks_cut"] == floor and tight["mean_blocks"] <= floor
    assert ample["cut_by_deadline"] == 0.0 and ample["fewest_blocks_cut"] is None
    assert 0.0 <= tight["accuracy"] <= 1.0 and sum(tight["blocks_histogram"].values()) == 6
    assert (
        unbounded["deadline_ms"] is None and unbounded["cut_by_deadline"] == 0.0 and unbounded["within_deadline"] == 1.0
    )
