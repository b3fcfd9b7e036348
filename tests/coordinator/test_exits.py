"""Exit rules, calibration and the adaptive policy file: pure logic on controlled logits and tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layerswarm.coordinator.routing.exits import AdaptiveDefaults, ExitRuleError, load_defaults, request_policy
from layerswarm.coordinator.routing.planner import Plan, Step, with_repeats
from layerswarm.models.adaptive_policy import POLICY_FILE, read_policy, write_policy
from layerswarm.models.checkpoint import ModelDirError, read_manifest
from layerswarm.models.exits import ExitPolicy, ExitRule, ExitTracker, simulate
from layerswarm.training.data.datasets import Dataset
from layerswarm.training.evaluation.adaptive import calibrate_model
from layerswarm.training.evaluation.calibrate import (
    CalibrationPlan,
    calibrate_anytime,
    calibrate_exits,
    choose,
    loss_standard_errors,
    sweep,
)


def logits_for(probs: list[list[float]]) -> torch.Tensor:
    """(hops, classes) probabilities -> logits whose softmax gives them back."""
    return torch.tensor(probs).log()


SURE_AT_THIRD = logits_for([[0.4, 0.3, 0.3], [0.6, 0.2, 0.2], [0.96, 0.02, 0.02], [0.98, 0.01, 0.01]])


def exit_hop(policy: ExitPolicy, hops: torch.Tensor) -> int | None:
    tracker = ExitTracker(policy)
    for i in range(hops.shape[0]):
        if bool(tracker.step(hops[i : i + 1])[0]):
            return i + 1
    return None


def test_confidence_exits_at_the_first_hop_over_threshold() -> None:
    assert exit_hop(ExitPolicy(ExitRule.CONFIDENCE, 0.95), SURE_AT_THIRD) == 3
    assert exit_hop(ExitPolicy(ExitRule.CONFIDENCE, 0.5), SURE_AT_THIRD) == 2
    assert exit_hop(ExitPolicy(ExitRule.CONFIDENCE, 0.99), SURE_AT_THIRD) is None


def test_entropy_exits_once_normalised_entropy_is_low() -> None:
    assert exit_hop(ExitPolicy(ExitRule.ENTROPY, 0.2), SURE_AT_THIRD) == 3
    assert exit_hop(ExitPolicy(ExitRule.ENTROPY, 1.0), SURE_AT_THIRD) == 1  # uniform-ish still <= 1
    assert exit_hop(ExitPolicy(ExitRule.ENTROPY, 0.0), SURE_AT_THIRD) is None


def test_patience_counts_unchanged_predictions_and_resets_on_change() -> None:
    flip = logits_for([[0.5, 0.4, 0.1], [0.4, 0.5, 0.1], [0.4, 0.5, 0.1], [0.5, 0.4, 0.1], [0.5, 0.4, 0.1]])
    assert exit_hop(ExitPolicy(ExitRule.PATIENCE, 1), flip) == 3  # 1 -> 2 changed, 2 -> 3 unchanged
    assert exit_hop(ExitPolicy(ExitRule.PATIENCE, 2), flip) is None  # the streak breaks at hop 4
    assert exit_hop(ExitPolicy(ExitRule.PATIENCE, 2), SURE_AT_THIRD) == 3  # class 0 from the first hop


def test_simulate_respects_min_blocks_and_answers_from_the_exit_hop() -> None:
    prefix = torch.stack([SURE_AT_THIRD, SURE_AT_THIRD.flip(1)])  # second row: other class, same shape
    depth, answer = simulate(prefix, ExitPolicy(ExitRule.CONFIDENCE, 0.5), min_blocks=1)
    assert depth.tolist() == [2, 2]
    depth, answer = simulate(prefix, ExitPolicy(ExitRule.CONFIDENCE, 0.5), min_blocks=3)
    assert depth.tolist() == [3, 3] and answer.argmax(-1).tolist() == [0, 2]
    depth, _ = simulate(prefix, ExitPolicy(ExitRule.CONFIDENCE, 0.999), min_blocks=1)
    assert depth.tolist() == [4, 4]  # never sure: the full path


@pytest.mark.parametrize(
    ("rule", "threshold"), [("confidence", 0.0), ("confidence", 1.5), ("entropy", -0.1), ("patience", 1.5)]
)
def test_invalid_thresholds_are_refused(rule: str, threshold: float) -> None:
    with pytest.raises(ExitRuleError):
        request_policy(AdaptiveDefaults(), rule, threshold, None)


def test_request_policy_precedence() -> None:
    defaults = AdaptiveDefaults(ExitPolicy(ExitRule.ENTROPY, 0.1), {"patience": 2.0, "entropy": 0.1})
    assert request_policy(defaults, None, None, None) == defaults.exit
    assert request_policy(defaults, "none", None, None) is None
    assert request_policy(defaults, "patience", None, None) == ExitPolicy(ExitRule.PATIENCE, 2)
    assert request_policy(defaults, None, None, 0.8) == ExitPolicy(ExitRule.CONFIDENCE, 0.8)
    assert request_policy(defaults, None, 0.3, None) == ExitPolicy(ExitRule.ENTROPY, 0.3)
    with pytest.raises(ExitRuleError, match="needs exit_threshold"):
        request_policy(defaults, "confidence", None, None)


def synthetic_prefix(n: int = 400, hops: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits that sharpen with depth towards the label, easy rows early and hard rows late."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 5, (n,), generator=gen)
    ease = torch.rand(n, generator=gen) * 3
    steps = []
    for h in range(hops):
        logits = torch.randn(n, 5, generator=gen) * 0.5
        logits[torch.arange(n), y] += ease * (h + 1)
        steps.append(logits)
    return torch.stack(steps, 1), y


def test_sweep_trades_accuracy_for_blocks_and_choose_keeps_the_margin() -> None:
    prefix, y = synthetic_prefix()
    points = sweep(prefix, y, ExitRule.CONFIDENCE, min_blocks=1)
    blocks = [p["mean_blocks"] for p in points]
    assert blocks == sorted(blocks) and blocks[0] < blocks[-1]  # stricter thresholds run more blocks
    full = float((prefix[:, -1].argmax(-1) == y).float().mean())
    chosen = choose(points, full, 0.01)
    assert chosen is not None and chosen["accuracy"] >= full - 0.01 and chosen["mean_blocks"] < prefix.shape[1]
    assert choose(points, 2.0, 0.01) is None  # nothing can reach an impossible accuracy


def test_the_chosen_exit_keeps_standard_errors_of_its_loss_to_spare() -> None:
    """The cheapest of many thresholds, chosen on one half, loses more on the other than it did there: the
    chosen one must stay inside the margin with `spare_se` standard errors of its (paired) loss to spare."""
    prefix, y = synthetic_prefix(n=600)
    points = sweep(prefix, y, ExitRule.CONFIDENCE, min_blocks=1)
    full = float((prefix[:, -1].argmax(-1) == y).float().mean())
    se = loss_standard_errors(prefix, y, ExitRule.CONFIDENCE, 1)
    assert set(se) == {p["threshold"] for p in points} and all(v >= 0 for v in se.values())
    assert se[1.0] == 0.0  # a threshold that never exits answers as the full path does: nothing lost
    plain, spared = choose(points, full, 0.01), choose(points, full, 0.01, {t: 2 * v for t, v in se.items()})
    assert plain is not None and spared is not None
    assert spared["accuracy"] >= full - 0.01 + 2 * se[spared["threshold"]]
    assert spared["mean_blocks"] >= plain["mean_blocks"]  # what the spare costs
    tight = calibrate_exits(prefix, y, CalibrationPlan(margin=0.01, spare_se=3.0))
    loose = calibrate_exits(prefix, y, CalibrationPlan(margin=0.01, spare_se=0.0))
    assert tight["spare_se"] == 3.0
    for rule in ("confidence", "entropy"):
        t, lo = tight["rules"][rule]["chosen"], loose["rules"][rule]["chosen"]
        assert lo is not None and (t is None or t["calibration"]["mean_blocks"] >= lo["calibration"]["mean_blocks"])


def test_calibrate_exits_picks_a_default_rule() -> None:
    prefix, y = synthetic_prefix(n=600)
    report = calibrate_exits(prefix, y, CalibrationPlan(margin=0.01))
    assert report["default"] is not None and report["default"]["rule"] in ("confidence", "entropy", "patience")
    assert all(r["curve"] for r in report["rules"].values())


def test_anytime_floor_is_the_fewest_blocks_within_the_margin() -> None:
    """Rows right from hop 3 on (of 4): the floor is 3 within a point, 1 within 100 points; each hop's
    accuracy is reported on both halves (a floor taken from the wrong hop, or off by one, fails this)."""
    right = torch.stack([SURE_AT_THIRD] * 4)  # class 0 from the first hop
    wrong_early = torch.stack([SURE_AT_THIRD.flip(1)[:2].flip(0)] * 4)  # class 2 after hops 1 and 2
    prefix = torch.cat([wrong_early, right[:, 2:]], 1)
    y = torch.zeros(4, dtype=torch.long)
    tight = calibrate_anytime(prefix, y, CalibrationPlan(anytime_margin=0.01))
    assert tight["min_blocks"] == 3 and tight["curve"]["2"] == {"calibration": 0.0, "held_out": 0.0}
    assert tight["curve"]["3"]["held_out"] == 1.0
    assert calibrate_anytime(prefix, y, CalibrationPlan(anytime_margin=1.0))["min_blocks"] == 1


def test_calibration_writes_a_hashed_policy_the_coordinator_reads(model_dir: Path) -> None:
    manifest = read_manifest(model_dir)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(80, 3, 16, 16, generator=gen)
    y = torch.randint(0, 4, (80,), generator=gen)
    data = Dataset("t", "t", x, y, x, y, ("a", "b", "c", "d"))
    result = calibrate_model(model_dir, data, CalibrationPlan(chunk=10), write=True)
    assert (model_dir / POLICY_FILE).is_file()
    listed = json.loads((model_dir / "manifest.json").read_text())["policy_files"][POLICY_FILE]["sha256"]
    assert listed == result["policy_sha256"]
    assert read_manifest(model_dir).model_id == manifest.model_id  # the policy does not change the model id
    policy = read_policy(model_dir)
    assert policy is not None and policy["model_id"] == manifest.model_id and "exit" in policy
    assert policy["exit_min_blocks"] == 1 and 1 <= policy["anytime_min_blocks"] <= 3
    write_policy(model_dir, {**policy, "exit": {"rule": "patience", "threshold": 2}, "exit_min_blocks": 2})
    defaults = load_defaults(model_dir, "calibrated", None)
    assert defaults.exit == ExitPolicy(ExitRule.PATIENCE, 2) and defaults.exit_min_blocks == 2
    assert defaults.anytime_min_blocks == policy["anytime_min_blocks"]
    assert load_defaults(model_dir, "none", None).exit is None
    (model_dir / POLICY_FILE).write_text((model_dir / POLICY_FILE).read_text().replace("patience", "entropy"))
    with pytest.raises(ModelDirError, match="sha256"):
        load_defaults(model_dir, "calibrated", None)


def test_no_policy_file_means_no_default_exit(model_dir: Path) -> None:
    assert read_policy(model_dir) is None and load_defaults(model_dir, "calibrated", None).exit is None
    with pytest.raises(ValueError, match="needs --exit-threshold"):
        load_defaults(model_dir, "entropy", None)


def test_with_repeats_fills_the_path_to_min_depth_with_marked_repeats() -> None:
    import random

    plan = Plan([Step(0, []), Step(3, [])], unreachable=[1, 2])
    filled = with_repeats(plan, 4, random.Random(0), shuffle=True)
    blocks = [s.block for s in filled.steps]
    assert len(blocks) == 4 and set(blocks) == {0, 3}
    assert sum(s.repeat for s in filled.steps) == 2
    assert all(not s.repeat for s in filled.steps if blocks.index(s.block) == filled.steps.index(s))
    assert with_repeats(plan, 2, random.Random(0), shuffle=True) is plan  # enough distinct indices: unchanged
    ordered = with_repeats(plan, 3, random.Random(0), shuffle=False)
    assert [s.block for s in ordered.steps] == sorted(s.block for s in ordered.steps)
