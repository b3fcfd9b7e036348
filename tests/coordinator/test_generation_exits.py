"""Early exit's options (coordinator/generation/exits.py, options.py): spellings, the refusals that name
`early_exit`, and how a request's choice and the server's defaults of the two decoding modes settle."""

from __future__ import annotations

import pytest

from layerswarm.coordinator.generation.exits import Calibrated, ExitRule, resolve
from layerswarm.coordinator.generation.options import (
    NO_EXIT,
    EarlyExit,
    GenerationOptions,
    InvalidGeneration,
    Speculation,
    parse_early_exit,
)

MODEL = Calibrated(threshold=0.95, min_blocks=2)
OFF = Speculation()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("off", NO_EXIT),
        (False, NO_EXIT),
        (None, NO_EXIT),
        ("on", EarlyExit(on=True)),
        (True, EarlyExit(on=True)),
        (0.9, EarlyExit(on=True, threshold=0.9)),
        ("0.5", EarlyExit(on=True, threshold=0.5)),
        (1, EarlyExit(on=True, threshold=1.0)),
    ],
)
def test_spellings(value: object, expected: EarlyExit) -> None:
    assert parse_early_exit(value) == expected


@pytest.mark.parametrize("bad", ["fast", 0, -1, 1.01, "nan", float("nan"), [0.9], {"threshold": 0.9}])
def test_bad_values_name_the_parameter(bad: object) -> None:
    with pytest.raises(InvalidGeneration) as caught:
        parse_early_exit(bad)
    assert caught.value.param == "early_exit" and "early_exit" in str(caught.value)


def test_on_takes_the_calibrated_threshold_and_a_number_overrides_it() -> None:
    _, rule = resolve(GenerationOptions(early_exit=EarlyExit(on=True)), NO_EXIT, OFF, MODEL)
    assert rule == ExitRule(0.95, 2)
    _, rule = resolve(GenerationOptions(early_exit=EarlyExit(on=True, threshold=0.8)), NO_EXIT, OFF, MODEL)
    assert rule == ExitRule(0.8, 2)
    _, rule = resolve(GenerationOptions(), EarlyExit(on=True), OFF, MODEL)  # the server's default
    assert rule == ExitRule(0.95, 2)
    options, rule = resolve(GenerationOptions(), NO_EXIT, OFF, MODEL)
    assert rule is None and options.early_exit == NO_EXIT and options.speculation == OFF


def test_on_without_a_calibration_is_refused() -> None:
    with pytest.raises(InvalidGeneration) as caught:
        resolve(GenerationOptions(early_exit=EarlyExit(on=True)), NO_EXIT, OFF, Calibrated(None, 1))
    assert caught.value.param == "early_exit" and caught.value.code == "not_calibrated"


def test_both_modes_asked_for_are_refused_and_a_request_overrides_the_other_default() -> None:
    both = GenerationOptions(early_exit=EarlyExit(on=True), speculation=Speculation(k=2))
    with pytest.raises(InvalidGeneration) as caught:
        resolve(both, NO_EXIT, OFF, MODEL)
    assert caught.value.code == "conflict" and "speculation" in str(caught.value)
    options, rule = resolve(GenerationOptions(speculation=Speculation(k=2)), EarlyExit(on=True), OFF, MODEL)
    assert rule is None and options.speculation == Speculation(k=2)  # the server's exit default yields
    options, rule = resolve(GenerationOptions(early_exit=EarlyExit(on=True)), NO_EXIT, Speculation(k=3), MODEL)
    assert rule == ExitRule(0.95, 2) and options.speculation == OFF  # and so does its speculation default
