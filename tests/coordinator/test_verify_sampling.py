"""The verification rule's guarantee (coordinator/verification/sampling.py), over 100 seeds:

- the rule alone: a long-proven node that turns and lies on every hop is caught within 50 of its hops in
  at least 99 seeds of 100 (the sampling floor; at the old flat 5 % it escaped in about a quarter);
- the whole rule on the shipped family's real blocks (bench/verify_sim.py: sampling, residual screen,
  decisive hop): a turncoat, a 5 % liar and a subtle targeted liar are each caught within 50 requests of
  their first lie in at least 99 seeds of 100, and no honest node is ever convicted.
"""

from __future__ import annotations

import random

import torch

from layerswarm.bench import verify_sim
from layerswarm.coordinator.verification.decisive import decisive_hops, movement
from layerswarm.coordinator.verification.sampling import check_probability, escape_probability, hops_for
from layerswarm.coordinator.verification.verifier import VerifySettings

RATE = VerifySettings().rate
SEEDS, WITHIN = 100, 50


def caught_within(lie_share: float, passed: int, seed: int) -> int | None:
    """Hops until a node lying on `lie_share` of them is drawn on a lie, by the rule alone (None: escaped)."""
    rng = random.Random(seed)
    for hop in range(WITHIN):
        lied = rng.random() < lie_share
        if rng.random() < check_probability(RATE, passed, suspicious=False) and lied:
            return hop
    return None


def test_a_long_proven_turncoat_is_caught_within_50_hops_by_sampling_alone() -> None:
    caught = sum(caught_within(1.0, passed=100_000, seed=s) is not None for s in range(SEEDS))
    assert caught >= 99
    floor = check_probability(RATE, 100_000, suspicious=False)
    assert hops_for(0.99, 1.0, floor) <= WITHIN and escape_probability(1.0, floor, WITHIN) <= 0.01


def test_new_nodes_are_checked_more_than_proven_ones_and_suspicion_more_still() -> None:
    new, proven = check_probability(RATE, 0, False), check_probability(RATE, 1000, False)
    assert new > proven > 0 and check_probability(RATE, 1000, True) > proven


def test_the_decisive_hop_is_the_one_that_moved_the_prediction_most() -> None:
    flat = torch.full((1, 4), 0.25).log()
    sure = torch.tensor([[0.97, 0.01, 0.01, 0.01]]).log()
    log_probs = torch.stack([flat, flat, sure, sure])  # hop 1 made up the model's mind, hops 0 and 2 did not
    assert decisive_hops(log_probs, 1) == [1] and movement(log_probs)[1] > 0


async def test_turncoat_rare_and_targeted_liars_are_caught_within_50_requests_in_99_of_100_seeds() -> None:
    liars = tuple(liar for liar in verify_sim.LIARS if liar.name in verify_sim.TARGETS)
    report = await verify_sim.run(SEEDS, WITHIN, liars)
    for name in verify_sim.TARGETS:
        row = report["liars"][name]
        assert row["caught_within"] >= 99, (name, row)
        assert row["honest_convicted"] == 0, (name, row)
