"""The two statistics node, coordinator, benchmarks and chaos report all use, defined once."""

from __future__ import annotations

from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float:
    """The q-quantile by rank (no interpolation): the value below which a fraction q of the values lie.
    Raises ValueError on no values."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of no values")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ewma(previous: float | None, sample: float, alpha: float = 0.2) -> float:
    """Exponentially weighted moving average: recent latencies count most; the first sample starts it."""
    return sample if previous is None else (1 - alpha) * previous + alpha * sample
