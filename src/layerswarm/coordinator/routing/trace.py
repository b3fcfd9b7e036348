"""The trace a request's path leaves: each hop's record (Hop, Attempt) and the result (PathResult).
Plain data, shared by the star executor (executor.py), relay chains (relay/chains.py), the deferred
checks (deferred.py), the HTTP responses and the metrics: apart from the executor so that none of
them needs its machinery."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Attempt:
    node: str
    model_id: str | None
    block: int
    error: str


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

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["latency_ms"] = round(self.latency_ms, 3)
        for key in ("tokens", "wire_bytes", "wire"):  # image traces keep their keys
            if data[key] is None:
                data.pop(key)
        return data


@dataclass
class PathResult:
    activations: torch.Tensor
    hops: list[Hop]
    unreachable: list[int]
    exited_early: bool = False
    anytime: bool = False  # answered early because the deadline left no time for the next hop
    topology: str = "star"  # star | relay (coordinator/relay.py)
    # relay chains that ended early: kind (not_started | handed_back | discarded), after_step, reason
    handbacks: list[dict[str, Any]] = field(default_factory=list)
    chains: int = 0  # relay chains started (each ends complete or in one hand-back)
    network: dict[str, Any] | None = None  # network-aware plan: predicted vs actual time
    discarded: list[Hop] = field(default_factory=list)  # hops thrown away by rewinds (deferred.py)

    @property
    def depth(self) -> int:
        return sum(1 for h in self.hops if h.block is not None)

    def topology_trace(self) -> dict[str, Any]:
        """Relay chains' hand-backs and the network-aware plan, for the request's trace."""
        data: dict[str, Any] = {"topology": self.topology, "handbacks": self.handbacks}
        if self.network is not None:
            data["network"] = self.network
        return data


class DepthError(RuntimeError):
    """Fewer blocks ran than the request's minimum depth: the coordinator answers 503 with this."""
