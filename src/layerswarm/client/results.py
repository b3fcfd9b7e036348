"""Typed results of the coordinator's native API, parsed from its JSON replies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class SwarmError(Exception):
    """The coordinator answered with an error: `status` (HTTP), `error` (a code), `detail` (why)."""

    def __init__(self, status: int, error: str, detail: Any) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail = status, error, detail

    @property
    def retryable(self) -> bool:
        """Busy (429) or too few blocks reachable right now (503): worth another try after a pause."""
        return self.status in (429, 503)


@dataclass(frozen=True)
class Label:
    index: int
    label: str
    probability: float


@dataclass(frozen=True)
class Attempt:
    """A call of a hop that failed (why it was substituted or skipped)."""

    node: str
    model_id: str | None
    block: int
    error: str


@dataclass(frozen=True)
class Hop:
    position: int
    planned_block: int
    block: int | None  # None: skipped
    node: str | None
    model_id: str | None
    latency_ms: float
    outcome: str  # ok | hedged | substituted | skipped
    attempts: tuple[Attempt, ...] = ()


@dataclass(frozen=True)
class Trace:
    hops: tuple[Hop, ...]
    unreachable_blocks: tuple[int, ...]
    substituted: int
    skipped: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trace:
        hops = tuple(_hop(h) for h in data["hops"])
        return cls(hops, tuple(data["unreachable_blocks"]), data["substituted"], data["skipped"])


def _hop(data: dict[str, Any]) -> Hop:
    fields = Hop.__dataclass_fields__
    attempts = tuple(
        Attempt(**{k: v for k, v in a.items() if k in Attempt.__dataclass_fields__}) for a in data.get("attempts", ())
    )
    return Hop(**{k: v for k, v in data.items() if k in fields and k != "attempts"}, attempts=attempts)


def _path_fields(data: dict[str, Any]) -> dict[str, Any]:
    """What a single and a batch answer share: the path taken through the swarm and how it ended."""
    keys = ("policy", "seed", "depth", "exited_early", "elapsed_ms")
    return {**{k: data[k] for k in keys}, "trace": Trace.from_json(data["trace"])}


@dataclass(frozen=True)
class Classification:
    prediction: str
    labels: tuple[Label, ...]  # top-k, most probable first
    policy: str
    seed: int  # pass it back to repeat the same path choices
    depth: int  # blocks that ran
    exited_early: bool
    elapsed_ms: float
    trace: Trace
    exit_rule: str | None = None  # the rule that ended a route early
    anytime: bool = False  # answered early: the next hop would have missed `deadline_ms`
    routes: int = 1  # routes whose logits were averaged (`ensemble`)
    blocks: int = 0  # blocks run, all routes together

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Classification:
        return cls(
            prediction=data["prediction"],
            labels=tuple(Label(**label) for label in data["labels"]),
            **_path_fields(data),
            exit_rule=data.get("exit_rule"),
            anytime=bool(data.get("anytime", False)),
            routes=int(data.get("routes", 1)),
            blocks=int(data.get("blocks", 0)),
        )


@dataclass(frozen=True)
class ItemResult:
    prediction: str
    labels: tuple[Label, ...]


@dataclass(frozen=True)
class BatchClassification:
    """A batch runs as one path through the swarm: one trace, one answer per input, in order."""

    results: tuple[ItemResult, ...]
    policy: str
    seed: int
    depth: int
    exited_early: bool
    elapsed_ms: float
    trace: Trace

    @property
    def predictions(self) -> list[str]:
        return [r.prediction for r in self.results]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchClassification:
        results = tuple(
            ItemResult(r["prediction"], tuple(Label(**label) for label in r["labels"])) for r in data["results"]
        )
        return cls(results=results, **_path_fields(data))


@dataclass(frozen=True)
class Node:
    address: str
    state: str  # pending | healthy | ejected | quarantined | ignored
    reason: str
    model_id: str | None
    block: int | None
    device: str | None
    ewma_latency_ms: float | None
    in_flight: int
    served: int
    failed: int


@dataclass(frozen=True)
class SwarmView:
    ready: bool
    reason: str
    depth: int
    reachable_depth: int
    nodes: tuple[Node, ...]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SwarmView:
        fields = Node.__dataclass_fields__
        nodes = tuple(Node(**{k: v for k, v in n.items() if k in fields}) for n in data["nodes"])
        return cls(data["ready"], data["reason"], data["depth"], data["reachable_depth"], nodes)
