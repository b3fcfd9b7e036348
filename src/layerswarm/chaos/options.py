"""What a chaos run does (its defaults are the `layerswarm chaos` flags' defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChaosOptions:
    requests: int = 1000
    concurrency: int = 8
    seed: int = 0
    hold_s: float = 2.0  # how long each fault lasts
    warmup_s: float = 3.0  # fault-free time first (the "without faults" baseline)
    max_s: float = 600.0  # the whole run never lasts longer


QUICK = ChaosOptions(requests=200, concurrency=4, hold_s=1.0, warmup_s=2.0)  # CI: a few minutes
