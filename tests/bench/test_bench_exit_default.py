"""The shipped text family with default options through a swarm: it exits early, and eval's code on the
same requests in the live paths' orders gives the live answers, while eval's random orders are averaged
over several sets (one set's accuracy moves with the orders drawn)."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from layerswarm.bench import exit_default
from layerswarm.models.zoo import family_root, robust_members


def test_default_exits_and_eval_agrees_in_the_live_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exit_default, "ORDER_DRAWS", 3)
    member = robust_members(family_root("text"))[0]
    report = asyncio.run(exit_default.run([("text", member)], 12))["families"]["text"]
    assert report["default"]["mean_blocks"] < report["full"]["mean_blocks"]
    ev = report["eval_vs_live"]
    # the same orders: eval's code is the swarm's computation, answer for answer and exit for exit
    assert ev["same_orders"]["same_answer_share"] == 1.0 and ev["same_orders"]["same_blocks_share"] == 1.0
    assert ev["same_orders"]["accuracy_gap_points"] == 0.0
    draws = ev["eval_orders"]["draw_accuracies"]
    assert ev["eval_orders"]["draws"] == len(draws) == 3
    assert ev["eval_orders"]["accuracy"] == pytest.approx(statistics.fmean(draws), abs=1e-4)
    gap = abs(ev["eval_orders"]["accuracy"] - ev["live"]["accuracy"]) * 100
    assert ev["eval_orders"]["accuracy_gap_points"] == pytest.approx(gap, abs=0.02)
