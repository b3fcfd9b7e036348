"""How many blocks a request needs: three numbers, each with the one place its default comes from.

- readiness (`min_blocks`): block indices that must be reachable for a request to be answered at all.
  Fewer, and the request is refused (503) naming the indices no node serves; /readyz says the same.
  Default: the model's evaluated minimum useful depth (manifest policy `min_blocks`, written by
  `layerswarm eval`: the fewest blocks whose arbitrary-order accuracy stays within a point of full
  depth), else 1 for a model never evaluated. `--min-blocks` and a request's `min_blocks` override it.
- exit floor: no early exit before this depth (the exit rule decides when to stop from there; it may
  stop below the readiness minimum: the head is sure, whatever else is reachable). Default: the depth
  the exit thresholds were calibrated with (adaptive.json `exit_min_blocks`), else 1.
- anytime floor: the fewest blocks an answer cut by a request's `deadline_ms` may have; below it the
  path goes on and answers late. Default: the calibrated floor (adaptive.json `anytime_min_blocks`: the
  fewest blocks within `layerswarm eval --anytime-margin` of the full path), else the readiness minimum.

Pure: the values come in, the rule and the line that states it come out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


class DepthRuleView(TypedDict):
    depth: int
    min_blocks: int
    min_blocks_source: str
    anytime_min_blocks: int
    anytime_source: str
    repeats: bool


class ReadinessView(TypedDict):
    """What the coordinator's ready line says about it (process.Coordinator.readiness)."""

    min_blocks: int
    depth: int
    rule: str  # DepthRule.describe()


@dataclass(frozen=True)
class DepthRule:
    depth: int  # the model's blocks
    min_blocks: int  # readiness: reachable block indices needed to answer at all
    min_blocks_source: str  # where that number came from, in words
    anytime_min_blocks: int  # the fewest blocks an answer cut by a deadline may have
    anytime_source: str
    repeats: bool = False  # reachable indices run again to make up the readiness minimum (calibrated)

    def __post_init__(self) -> None:
        for name, value in (("min_blocks", self.min_blocks), ("anytime_min_blocks", self.anytime_min_blocks)):
            if not 1 <= value <= self.depth:
                raise ValueError(f"{name} {value} is not between 1 and the model's depth of {self.depth}")

    def describe(self) -> str:
        """The rule in one line: what the coordinator logs at start and `layerswarm up` prints."""
        spare = self.depth - self.min_blocks
        refill = "; repeats make up missing indices (calibrated)" if self.repeats else ""
        return (
            f"a request is answered while {self.min_blocks} of {self.depth} block indices are reachable "
            f"({self.min_blocks_source}; {spare} may be down{refill}), else 503 naming the missing ones; "
            f"answers cut by a deadline_ms keep at least {self.anytime_min_blocks} blocks ({self.anytime_source})"
        )

    def to_json(self) -> DepthRuleView:
        return {
            "depth": self.depth,
            "min_blocks": self.min_blocks,
            "min_blocks_source": self.min_blocks_source,
            "anytime_min_blocks": self.anytime_min_blocks,
            "anytime_source": self.anytime_source,
            "repeats": self.repeats,
        }


def missing_blocks(depth: int, reachable: set[int]) -> list[int]:
    """The block indices no routable node serves."""
    return [b for b in range(depth) if b not in reachable]
