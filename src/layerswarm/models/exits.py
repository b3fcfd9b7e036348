"""Early-exit rules, shared by calibration (`layerswarm eval`) and the coordinator.

Every rule reads only what the shared head says about the current activations and, for patience, the
predictions after earlier hops; none assumes which blocks ran or in which order, so they hold on the
random paths a LayerShuffle swarm takes.

- confidence: exit once the top class has probability >= threshold
- entropy: exit once the head's entropy, divided by log(classes) (so in [0, 1]), is <= threshold
- patience: exit once the prediction has stayed the same for `threshold` consecutive hops
  ("BERT Loses Patience"; the streak is 0 after the first hop)

The decision for one hop is `step`; both callers run exactly this function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor


class ExitRule(str, Enum):
    CONFIDENCE = "confidence"
    ENTROPY = "entropy"
    PATIENCE = "patience"


RULES = tuple(r.value for r in ExitRule)


@dataclass(frozen=True)
class ExitPolicy:
    rule: ExitRule
    threshold: float

    def __post_init__(self) -> None:
        problem = threshold_problem(self.rule, self.threshold)
        if problem:
            raise ValueError(problem)

    def to_json(self) -> dict[str, object]:
        return {"rule": self.rule.value, "threshold": self.threshold}


def threshold_problem(rule: ExitRule, threshold: float) -> str | None:
    """Why `threshold` is not valid for `rule` (None when it is)."""
    if not math.isfinite(threshold):
        return f"{rule.value} threshold must be finite"
    if rule is ExitRule.CONFIDENCE and not 0.0 < threshold <= 1.0:
        return "confidence threshold must be in (0, 1]"
    if rule is ExitRule.ENTROPY and not 0.0 <= threshold <= 1.0:
        return "entropy threshold (entropy / log classes) must be in [0, 1]"
    if rule is ExitRule.PATIENCE and (threshold < 1 or threshold != int(threshold)):
        return "patience threshold must be a whole number of hops >= 1"
    return None


@dataclass
class ExitTracker:
    """Per path: the previous prediction and the streak of unchanged predictions, one per batch row."""

    policy: ExitPolicy
    previous: Tensor | None = None
    streak: Tensor | None = None

    def step(self, logits: Tensor) -> Tensor:
        """Feed the head's logits (B, classes) after one more hop; True per row that may exit now."""
        probs = logits.float().softmax(-1)
        prediction = probs.argmax(-1)
        if self.previous is None or self.streak is None:
            self.streak = torch.zeros_like(prediction)
        else:
            self.streak = torch.where(prediction == self.previous, self.streak + 1, torch.zeros_like(self.streak))
        self.previous = prediction
        return signal(self.policy, probs, self.streak)


def signal(policy: ExitPolicy, probs: Tensor, streak: Tensor) -> Tensor:
    if policy.rule is ExitRule.CONFIDENCE:
        return probs.max(-1).values >= policy.threshold
    if policy.rule is ExitRule.ENTROPY:
        return normalised_entropy(probs) <= policy.threshold
    return streak >= int(policy.threshold)


def normalised_entropy(probs: Tensor) -> Tensor:
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
    return entropy / math.log(probs.shape[-1])


def simulate(prefix_logits: Tensor, policy: ExitPolicy, min_blocks: int) -> tuple[Tensor, Tensor]:
    """Where a path exits: prefix_logits (N, L, classes) holds the head's logits after each of L hops.
    Returns (blocks run per row, the logits answered per row), exits allowed from `min_blocks` on."""
    n, length, _ = prefix_logits.shape
    tracker = ExitTracker(policy)
    depth = torch.full((n,), length, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    for hop in range(length):
        may_exit = tracker.step(prefix_logits[:, hop])
        if hop + 1 >= min_blocks and hop + 1 < length:
            newly = may_exit & ~done
            depth[newly] = hop + 1
            done |= newly
    answer = prefix_logits[torch.arange(n), depth - 1]
    return depth, answer
