"""The trace a request's path leaves: each hop's record (Hop, Attempt) and the result (PathResult).
Plain data, shared by the star executor (executor.py), relay chains (relay/chains.py), the deferred
checks (deferred.py), the HTTP responses and the metrics: apart from the executor so that none of
them needs its machinery."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

import torch


class AttemptJson(TypedDict):
    node: str
    model_id: str | None
    block: int
    error: str


class _HopJson(TypedDict):
    position: int
    planned_block: int
    block: int | None
    node: str | None
    model_id: str | None
    latency_ms: float
    outcome: str
    hedged_to: str | None
    repeat: bool
    attempts: list[AttemptJson]
    send_ms: float | None


class HopJson(_HopJson, total=False):
    """One hop in a request's trace (the HTTP answers, the swarm page); the text and wire keys only
    where they apply, so image traces keep their keys."""

    tokens: int
    wire_bytes: int
    wire: str


class _ChainEnd(TypedDict):
    kind: Literal["not_started", "handed_back", "discarded"]
    after_step: int  # the path's last step the chain ran (-1: none of it counts)
    reason: str


class ChainEnd(_ChainEnd, total=False):
    """A relay chain that ended early (relay/chains.py), in the request's trace."""

    discounted: str  # why the hand-back's claim was not probed (relay/handbacks.py)


class NetworkTrace(TypedDict):
    """The network-aware plan of a route (--policy network): predicted against actual time."""

    predicted_ms: float
    actual_ms: float
    order: list[int]
    nodes: list[str]


class _TopologyTrace(TypedDict):
    topology: str
    handbacks: list[ChainEnd]


class TopologyTrace(_TopologyTrace, total=False):
    network: NetworkTrace


@dataclass
class Attempt:
    node: str
    model_id: str | None
    block: int
    error: str

    def to_json(self) -> AttemptJson:
        return {"node": self.node, "model_id": self.model_id, "block": self.block, "error": self.error}


@dataclass
class Hop:
    position: int
    planned_block: int
    block: int | None = None  # the block that actually ran (None: skipped)
    node: str | None = None
    model_id: str | None = None
    latency_ms: float = 0.0
    # ok | hedged (a second node answered first) | substituted | skipped | relayed | discarded (its input
    # derived from a reply that failed a deferred check: PathResult.discarded, rerun in `hops`)
    outcome: str = "ok"
    hedged_to: str | None = None  # the node a slow hop was also sent to
    repeat: bool = False  # a block index that already ran, run again on purpose (too few indices reachable)
    attempts: list[Attempt] = field(default_factory=list)
    send_ms: float | None = None  # relayed hops: forwarding to the next node (less its compute)
    tokens: int | None = None  # text: tokens this hop computed (frozen ones only read)
    wire_bytes: int | None = None  # text: tensor payload bytes of request and reply
    wire: str | None = None  # --wire-dtype auto: the dtype this hop's link was sent in

    def to_json(self) -> HopJson:
        data: HopJson = {
            "position": self.position,
            "planned_block": self.planned_block,
            "block": self.block,
            "node": self.node,
            "model_id": self.model_id,
            "latency_ms": round(self.latency_ms, 3),
            "outcome": self.outcome,
            "hedged_to": self.hedged_to,
            "repeat": self.repeat,
            "attempts": [a.to_json() for a in self.attempts],
            "send_ms": self.send_ms,
        }
        if self.tokens is not None:
            data["tokens"] = self.tokens
        if self.wire_bytes is not None:
            data["wire_bytes"] = self.wire_bytes
        if self.wire is not None:
            data["wire"] = self.wire
        return data


@dataclass
class PathResult:
    activations: torch.Tensor
    hops: list[Hop]
    unreachable: list[int]
    exited_early: bool = False
    anytime: bool = False  # answered early because the deadline left no time for the next hop
    topology: str = "star"  # star | relay (relay/chains.py)
    handbacks: list[ChainEnd] = field(default_factory=list)  # relay chains that ended early
    chains: int = 0  # relay chains started (each ends complete or in one hand-back)
    network: NetworkTrace | None = None  # network-aware plan: predicted vs actual time
    discarded: list[Hop] = field(default_factory=list)  # hops thrown away by rewinds (deferred.py)

    @property
    def depth(self) -> int:
        return sum(1 for h in self.hops if h.block is not None)

    def topology_trace(self) -> TopologyTrace:
        """Relay chains' hand-backs and the network-aware plan, for the request's trace."""
        data: TopologyTrace = {"topology": self.topology, "handbacks": self.handbacks}
        if self.network is not None:
            data["network"] = self.network
        return data


class DepthError(RuntimeError):
    """Fewer blocks ran than the request's minimum depth: the coordinator answers 503 with this, naming
    the block indices that had no node (`missing`)."""

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = sorted(set(missing))
