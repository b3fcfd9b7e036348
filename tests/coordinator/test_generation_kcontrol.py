"""The adaptive draft length (coordinator/generation/kcontrol.py, pure): longer drafts where trips are slow
and drafts are kept, short ones where drafts are rejected or drafting costs as much as a hop, and the
trip's cost per extra token learned from rounds of different k."""

from __future__ import annotations

from layerswarm.coordinator.generation.kcontrol import KController, expected_tokens


def settle(
    c: KController, rounds: int, acceptance: float, draft_s: float, trip_s: float, per_token_s: float = 0.0
) -> int:
    for _ in range(rounds):
        k = c.next_k()
        c.observe(k, round(k * acceptance), k * draft_s, trip_s + k * per_token_s)
    return c.best()


def test_expected_tokens_per_round() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def test_slow_trips_and_kept_drafts_make_long_drafts() -> None:
    fast_hops = settle(KController(), 40, 0.8, draft_s=0.001, trip_s=0.002)
    slow_hops = settle(KController(), 40, 0.8, draft_s=0.001, trip_s=0.050)
    assert slow_hops > fast_hops and slow_hops >= 6


def test_rejected_drafts_keep_k_at_its_floor() -> None:
    assert settle(KController(), 40, 0.0, draft_s=0.001, trip_s=0.010) == 1


def test_drafting_as_slow_as_a_trip_keeps_k_short() -> None:
    assert settle(KController(), 40, 0.6, draft_s=0.010, trip_s=0.010) <= 2


def test_the_trips_cost_per_token_is_learned_from_rounds_of_different_k() -> None:
    """Trips that grow 10 ms a token make extra drafts dear: k falls against trips of a flat cost."""
    flat = settle(KController(), 80, 0.9, draft_s=0.0005, trip_s=0.010)
    steep_control = KController()
    steep = settle(steep_control, 80, 0.9, draft_s=0.0005, trip_s=0.010, per_token_s=0.010)
    assert steep < flat
    base, per_token = steep_control._trips.fit()
    assert abs(per_token - 0.010) < 0.002 and abs(base - 0.010) < 0.004


def test_a_fork_starts_where_its_parent_stands_and_goes_its_own_way() -> None:
    parent = KController()
    settle(parent, 40, 0.8, draft_s=0.001, trip_s=0.050)
    child = parent.fork()
    assert child.best() == parent.best() and child.rounds == parent.rounds
    settle(child, 40, 0.0, draft_s=0.010, trip_s=0.050)  # nothing kept, drafting dearer: its own k
    assert child.best() == 1 and parent.best() >= 6


def test_drafts_kept_in_runs_make_longer_drafts_than_the_same_rate_spread_evenly() -> None:
    """Half the drafts kept either way: all or nothing per round (a run), or the first of every two.
    Runs make deep positions safe; the per-position estimate sees it, an independent-drafts model not."""
    runs, spread = KController(), KController()
    for i in range(60):
        k = runs.next_k()
        runs.observe(k, k if i % 2 else 0, 0.001 * k, 0.010)
        k = spread.next_k()
        spread.observe(k, min(1, k), 0.001 * k, 0.010)
    assert runs.best() > spread.best()
    assert runs.expected(4) > spread.expected(4) + 0.5  # 3.0 against 2.2


def test_acceptance_follows_the_stream() -> None:
    c = KController(acceptance=0.9)
    for _ in range(20):
        c.observe(4, 0, 0.004, 0.01)
    assert c.acceptance < 0.05
