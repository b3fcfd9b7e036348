"""Early exit on the coordinator: which rule a request runs under, and the per-route check.

The rule itself (confidence, entropy, patience) is `layerswarm.models.exits`, the same code that
calibration simulates; here it is fed the head's logits after every hop of a live path. The default
comes from the coordinator's settings: `calibrated` reads the model directory's adaptive policy
(written by `layerswarm eval --calibrate`), `none` turns early exit off, or a rule and threshold.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypedDict

import torch

from layerswarm.models.adaptive_policy import read_policy
from layerswarm.models.exits import ExitPolicy, ExitRule, ExitTracker, threshold_problem

from .request import InvalidRequest

log = logging.getLogger(__name__)

HeadFn = Callable[[torch.Tensor], Awaitable[torch.Tensor]]


class AdaptiveView(TypedDict):
    exit: dict[str, object] | None  # the default exit rule and threshold (models/exits.py)
    exit_min_blocks: int  # no exit before this depth
    thresholds: dict[str, float]
    ensemble_confidence: float
    repeats: bool
    source: str


@dataclass(frozen=True)
class AdaptiveDefaults:
    """The coordinator's adaptive-compute defaults (from its settings and the model's policy file)."""

    exit: ExitPolicy | None = None
    thresholds: dict[str, float] = field(default_factory=dict)  # calibrated threshold per rule
    ensemble_confidence: float = 0.9  # adaptive ensembles: a second route below this confidence
    repeats: bool = False  # eval showed that repeating blocks beats skipping them
    source: str = "none"
    exit_min_blocks: int = 1  # the exit floor the thresholds were calibrated with
    anytime_min_blocks: int | None = None  # the calibrated anytime floor (None: not calibrated)

    def to_json(self) -> AdaptiveView:
        return {
            "exit": None if self.exit is None else self.exit.to_json(),
            "exit_min_blocks": self.exit_min_blocks,
            "thresholds": self.thresholds,
            "ensemble_confidence": self.ensemble_confidence,
            "repeats": self.repeats,
            "source": self.source,
        }


def load_defaults(model_dir: Path, exit_setting: str, threshold: float | None) -> AdaptiveDefaults:
    """exit_setting: `calibrated` (the policy file's rule, or none without one), `none`, or a rule
    name (with `threshold`, or that rule's calibrated threshold)."""
    policy = read_policy(model_dir) or {}
    thresholds = {str(k): float(v) for k, v in (policy.get("exit_thresholds") or {}).items()}
    anytime = policy.get("anytime_min_blocks")
    base = AdaptiveDefaults(
        # files written before the floors had names of their own call the exit floor `min_blocks`
        exit_min_blocks=int(policy.get("exit_min_blocks", policy.get("min_blocks", 1))),
        anytime_min_blocks=int(anytime) if anytime is not None else None,
        thresholds=thresholds,
        ensemble_confidence=float(policy.get("ensemble_confidence") or 0.9),
        repeats=bool(policy.get("repeats", False)),
        source="policy file" if policy else "none",
    )
    if exit_setting == "none":
        return base
    if exit_setting == "calibrated":
        chosen = policy.get("exit")
        if not chosen:
            return base
        exit_policy = ExitPolicy(ExitRule(chosen["rule"]), float(chosen["threshold"]))
    else:
        value = threshold if threshold is not None else thresholds.get(exit_setting)
        if value is None:
            raise ValueError(f"--exit-rule {exit_setting} needs --exit-threshold (no calibrated threshold)")
        problem = threshold_problem(ExitRule(exit_setting), value)
        if problem:
            source = "--exit-threshold" if threshold is not None else f"calibrated {exit_setting} threshold"
            raise ValueError(f"{source} {value:g}: {problem}")
        exit_policy = ExitPolicy(ExitRule(exit_setting), value)
    return replace(base, exit=exit_policy)


class ExitRuleError(InvalidRequest):
    """A request's exit options do not make a policy: the caller's mistake, answered as InvalidRequest."""


def request_policy(
    defaults: AdaptiveDefaults, rule: str | None, threshold: float | None, legacy_confidence: float | None
) -> ExitPolicy | None:
    """The exit policy of one request: its own fields over the coordinator's default. Raises
    ExitRuleError for a rule without a threshold or a threshold out of the rule's range."""
    try:
        return _request_policy(defaults, rule, threshold, legacy_confidence)
    except ValueError as exc:
        raise ExitRuleError(str(exc)) from exc


def _request_policy(
    defaults: AdaptiveDefaults, rule: str | None, threshold: float | None, legacy_confidence: float | None
) -> ExitPolicy | None:
    if legacy_confidence is not None and rule is None:
        return ExitPolicy(ExitRule.CONFIDENCE, legacy_confidence)
    if rule == "none":
        return None
    if rule is None:
        if threshold is None:
            return defaults.exit
        if defaults.exit is None:
            raise ValueError("exit_threshold needs exit_rule (this coordinator has no default rule)")
        return ExitPolicy(defaults.exit.rule, threshold)
    value = threshold if threshold is not None else defaults.thresholds.get(rule)
    if value is None:
        raise ValueError(f"exit_rule {rule} needs exit_threshold (no calibrated threshold for it)")
    return ExitPolicy(ExitRule(rule), value)


class RouteExit:
    """One route's early-exit check: the head after every hop, the rule's decision from the exit floor
    on (calibration simulates exactly this: models/exits.simulate)."""

    def __init__(self, policy: ExitPolicy, head: HeadFn, min_blocks: int = 1) -> None:
        self.policy = policy
        self.min_blocks = min_blocks
        self.tracker = ExitTracker(policy)
        self.head = head
        self.checks = 0

    def save(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rule's state (a patience streak), restored when the path is rewound (deferred.py)."""
        return self.tracker.previous, self.tracker.streak

    def restore(self, state: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        self.tracker.previous, self.tracker.streak = state

    async def __call__(self, x: torch.Tensor, depth: int) -> bool:
        """After `depth` blocks ran: may the route stop here? The rule sees every hop (patience counts
        them), but fires only from the floor on."""
        self.checks += 1
        logits = await self.head(x)
        fired = bool(self.tracker.step(logits).all())  # a batch exits only when every row may
        return fired and depth >= self.min_blocks
