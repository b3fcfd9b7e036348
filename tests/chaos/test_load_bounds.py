"""The load generator stays bounded: at least the asked count, on until the schedule ends, never past its
time limit (what keeps a chaos run from hammering a swarm forever)."""

from __future__ import annotations

import asyncio
import time

from layerswarm.chaos.load import bounded_indices


def test_indices_stop_at_the_count_when_nothing_waits() -> None:
    assert list(bounded_indices(5, None, 60.0)) == [0, 1, 2, 3, 4]


def test_indices_go_on_until_the_schedule_is_done() -> None:
    done = asyncio.Event()
    taken = []
    for i in bounded_indices(3, done, 60.0):
        taken.append(i)
        if i == 7:
            done.set()
    assert taken == list(range(8))


def test_indices_never_pass_the_time_limit() -> None:
    """Even short of the asked count: the limit wins."""
    taken = []
    for i in bounded_indices(1_000, asyncio.Event(), 0.2):
        taken.append(i)
        time.sleep(0.05)
    assert 1 <= len(taken) <= 6
