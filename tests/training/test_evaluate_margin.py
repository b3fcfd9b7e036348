"""The eval's verdicts: the ensemble's margin over its best member (a paired bootstrap interval, and a
verdict that calls a margin inside the test set's noise what it is), and whether a baseline collapsed."""

from __future__ import annotations

import pytest
import torch

from layerswarm.training.evaluation.evaluate import check_targets, paired_interval


def test_a_clear_gain_has_an_interval_above_zero() -> None:
    diff = torch.zeros(1000)
    diff[:100] = 1.0  # the ensemble gets 100 more images right and none fewer
    lo, hi = paired_interval(diff, resamples=2000, seed=0)
    assert 0.07 < lo < 0.1 < hi < 0.13


def test_a_margin_of_a_few_images_either_way_straddles_zero() -> None:
    diff = torch.zeros(1000)
    diff[:30], diff[30 : 25 + 30] = 1.0, -1.0  # +30 -25: half a point up, as the README's families were
    lo, hi = paired_interval(diff, resamples=2000, seed=0)
    assert lo < 0 < hi


def test_pairing_cancels_what_both_get_right_or_wrong() -> None:
    # Identical per-image results: no difference at all, however noisy each side is.
    assert paired_interval(torch.zeros(500), resamples=500, seed=1) == (0.0, 0.0)


def test_the_interval_is_reproducible_from_its_seed() -> None:
    diff = torch.randint(-1, 2, (800,)).float()
    assert paired_interval(diff, 700, seed=3) == paired_interval(diff, 700, seed=3)


def _report(interval: list[float] | None) -> dict:  # type: ignore[type-arg]
    group = {
        "variant": "layershuffle",
        "sequential": 0.9,
        "arbitrary": {"mean": 0.9},
        "merged": {"mean": 0.9},
        "ensemble": 0.905,
        "best_member_arbitrary": 0.9,
        "pruned": {"1": {"arbitrary": 0.5}, "2": {"arbitrary": 0.9}},
    }
    if interval is not None:
        group["ensemble_minus_best_member_ci95"] = interval
    return {"groups": {"f/layershuffle": group}, "models": {}}


@pytest.mark.parametrize(
    ("interval", "verdict"),
    [([0.001, 0.009], "above"), ([-0.004, 0.014], "within noise"), ([-0.02, -0.001], "below")],
)
def test_the_verdict_follows_the_interval_not_the_point_estimate(interval: list[float], verdict: str) -> None:
    targets = check_targets(_report(interval), chance=0.1)["f/layershuffle"]
    assert targets["ensemble_minus_best_member"] == pytest.approx(0.005)
    assert targets["ensemble_vs_best_member"] == verdict
    assert targets["ensemble_minus_best_member_ci95"] == interval


def test_a_report_from_before_the_interval_gets_no_verdict() -> None:
    targets = check_targets(_report(None), chance=0.1)["f/layershuffle"]
    assert "ensemble_vs_best_member" not in targets and targets["ensemble_minus_best_member"] == pytest.approx(0.005)


def _baseline(sequential: float, arbitrary: float) -> dict:  # type: ignore[type-arg]
    model = {"variant": "baseline", "sequential": sequential, "arbitrary": {"mean": arbitrary}}
    model["pruned"] = {"1": {"arbitrary": 0.2}, "2": {"arbitrary": arbitrary}}
    return {"groups": {}, "models": {"baseline": model}}


@pytest.mark.parametrize(
    ("sequential", "arbitrary", "chance", "kept", "collapsed"),
    [
        (0.8261, 0.0013, 0.001, 0.0004, True),  # the paper's ViT-B/16
        (0.536, 0.148, 0.125, 0.056, True),  # near chance
        (0.878, 0.652, 0.125, 0.700, False),  # lost a quarter: far below in-order, not a collapse
        (0.5, 0.4, 0.1, 0.75, False),
    ],
)
def test_a_baseline_collapses_when_it_keeps_a_tenth_of_what_it_learnt(
    sequential: float, arbitrary: float, chance: float, kept: float, collapsed: bool
) -> None:
    targets = check_targets(_baseline(sequential, arbitrary), chance=chance)["baseline"]
    assert targets["baseline_kept_above_chance"] == pytest.approx(kept, abs=5e-4)
    assert targets["baseline_collapsed"] is collapsed


def test_a_baseline_that_learnt_nothing_has_nothing_to_lose() -> None:
    targets = check_targets(_baseline(0.1, 0.1), chance=0.1)["baseline"]
    assert targets["baseline_kept_above_chance"] == 1.0 and not targets["baseline_collapsed"]


def test_the_own_data_table_shows_the_interval_and_the_verdict() -> None:
    from layerswarm.bench.own_data import _collapse, _family, _margin

    group = {
        "arbitrary_over_sequential": 1.0,
        "merged_over_arbitrary": 1.0,
        "ensemble_minus_best_member": 0.005,
        "ensemble_minus_best_member_ci95": [-0.004, 0.014],
        "ensemble_vs_best_member": "within noise",
        "pruning_monotone_arbitrary": True,
    }
    report = {
        "targets": {"f/layershuffle": group, "baseline": {"baseline_arbitrary_minus_chance": 0.3}},
        "models": {"baseline": {"variant": "baseline", "sequential": 0.8, "arbitrary": {"mean": 0.4}}},
        "chance": 0.125,
    }
    assert _margin(_family(report)) == "+0.50 points [-0.40, +1.40], within noise"
    assert _collapse(_family(report)) == "0.41, not collapsed"  # (0.4 - 0.125) / (0.8 - 0.125)
    report["models"]["baseline"]["arbitrary"]["mean"] = 0.15
    assert _collapse(_family(report)) == "0.04, **collapsed**"
    del group["ensemble_minus_best_member_ci95"], group["ensemble_vs_best_member"]  # a report from before
    assert _margin(_family(report)) == "+0.50 points"
