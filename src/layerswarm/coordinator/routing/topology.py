"""`--topology auto`: star or relay per request, whichever has been faster here (pure bookkeeping).

Predictions from link estimates miss what costs most on a fast network (per-hop stack overhead, a
busy CPU), so the choice is made from measured outcomes: the EWMA of each topology's time per hop
(path time over blocks run) on real requests. The faster one is used; the other is still tried on a
small share of requests (and until each has a few samples) so that a change in the network is noticed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TypedDict

from layerswarm.wire.stats import ewma

TOPOLOGIES = ("star", "relay")
MIN_SAMPLES = 3  # per topology, before the comparison is trusted
EXPLORE = 0.05  # share of requests that try the slower topology
ALPHA = 0.2  # the EWMA's weight of a new sample


class TopologyView(TypedDict):
    ms_per_hop: float | None
    samples: int


class TopologyState(TypedDict):
    setting: str  # star | relay | auto
    relay_available: bool  # a swarm token and a relay: chains can run
    why: str
    measured: dict[str, TopologyView] | None  # under auto: each topology's EWMA time per hop


@dataclass
class TopologyChooser:
    rng: random.Random = field(default_factory=random.Random)
    ms_per_hop: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOPOLOGIES, 0))

    def choose(self) -> str:
        young = [t for t in TOPOLOGIES if self.samples[t] < MIN_SAMPLES]
        if young:
            return min(young, key=lambda t: self.samples[t])
        best = min(TOPOLOGIES, key=lambda t: self.ms_per_hop[t])
        if self.rng.random() < EXPLORE:
            return next(t for t in TOPOLOGIES if t != best)
        return best

    def observe(self, topology: str, elapsed_ms: float, hops: int) -> None:
        if hops <= 0 or topology not in self.samples:
            return
        value = elapsed_ms / hops
        self.ms_per_hop[topology] = ewma(self.ms_per_hop.get(topology), value, ALPHA)
        self.samples[topology] += 1

    def to_json(self) -> dict[str, TopologyView]:
        return {
            t: {"ms_per_hop": round(self.ms_per_hop[t], 3) if t in self.ms_per_hop else None, "samples": n}
            for t, n in self.samples.items()
        }
