"""The fault wrapper's liars lie when they say they will: the rogue bench and chaos rest on it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from layerswarm.harness.faults import FaultSpec, LieSchedule


def test_a_turncoat_is_honest_for_its_first_replies_then_lies_on_every_one() -> None:
    schedule = LieSchedule(FaultSpec("noise", after=10))
    lies = [schedule.lies_next() for _ in range(30)]
    assert lies == [False] * 10 + [True] * 20


def test_a_rare_liar_lies_on_about_its_share_and_repeats() -> None:
    spec = FaultSpec("noise", after=10, rate=0.05)
    schedule, again = LieSchedule(spec), LieSchedule(spec)
    lies = [schedule.lies_next() for _ in range(4010)]
    assert not any(lies[:10])
    assert 0.035 < sum(lies[10:]) / 4000 < 0.065  # 200 expected: a liar on every reply, or never, fails
    assert lies == [again.lies_next() for _ in range(4010)]  # the same replies in every run


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5])
def test_a_share_outside_0_1_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="--fault-rate"):
        FaultSpec("noise", rate=rate)


def test_the_wrapper_names_the_flag_it_refuses() -> None:
    cmd = [sys.executable, "-m", "layerswarm.harness.faults", "--fault-mode", "noise", "--fault-rate", "2"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--fault-rate" in done.stderr and "Traceback" not in done.stderr
