"""What the coordinator knows about one node: its proved identity, its state and its latency record,
and the evidence verification found against it.

Plain data with small derived views (routable, score, JSON); the registry (registry.py) changes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TypedDict

from layerswarm.wire.stats import quantile

MDNS = "mdns"  # the hint an mDNS advert leaves (a candidate's only hint until it is proved)


class _Finding(TypedDict):
    check: str  # what was checked: hard range, activation statistics, re-execution, re-execution on peers
    against: str  # what the reply was held against
    discrepancy: str  # how far off it was


class Evidence(_Finding, total=False):
    """What verification found against a node's reply (verification/), kept with its record when it
    is quarantined and shown in /v1/nodes: the finding, and where and when it was caught."""

    position: int  # the hop's position in the path
    tolerance: float  # the relative error allowed (re-execution)
    range_filter: str  # the soft range finding that forced the re-execution
    hops_before_detection: int
    seconds_since_first_hop: float
    at: float  # Unix seconds


class RecordView(TypedDict):
    """A node record as /v1/nodes and the swarm page show it."""

    address: str
    source: str
    state: str
    reason: str
    family_id: str | None
    model_id: str | None
    block: int | None
    variant: str | None
    device: str | None
    boot_id: str | None
    weights_sha256: str | None
    ewma_latency_ms: float | None
    in_flight: int
    served: int
    failed: int
    consecutive_failures: int
    hints: list[str]
    evidence: list[Evidence]


class NodeState(str, Enum):
    PENDING = "pending"  # heard of, identity not confirmed yet
    HEALTHY = "healthy"  # routable
    EJECTED = "ejected"  # failing health checks or requests; re-admitted when it recovers
    QUARANTINED = "quarantined"  # returned malformed activations; re-admitted only after a cool-down
    IGNORED = "ignored"  # not ours (other family, protocol, shape, or refused weights)


@dataclass(frozen=True)
class StreamLimits:
    """What a decoder node admits (its Info's stream_limits): the generation planner keeps within it."""

    max_streams: int  # streams held at once (past it the node evicts its least recently used idle one)
    max_seq_len: int  # tokens per stream
    max_cache_bytes: int
    idle_timeout_s: float  # a stream not stepped for this long is freed by the node


@dataclass(frozen=True)
class NodeIdentity:
    """What a node says it serves (from its Info reply)."""

    family_id: str
    model_id: str
    block: int
    variant: str
    weights_sha256: str
    boot_id: str
    protocol_version: int
    depth: int
    tokens: int
    dim: int
    shuffle_robust: bool
    device: str = "cpu"
    trace_key: bytes = b""  # Ed25519 public key for its relay trace entries (empty: an older node)
    stream_limits: StreamLimits | None = None  # decoder nodes only (None: a classifier's block)


@dataclass(frozen=True)
class FamilySpec:
    """What the coordinator serves: nodes must match this to be routable."""

    family_id: str
    depth: int
    tokens: int
    dim: int
    known_weights: dict[tuple[str, int], str] = field(default_factory=dict)  # (model, block) -> sha256
    strict: bool = False  # admit only (model, block) pairs known_weights lists, with exactly that sha256
    generative: bool = False  # a decoder family: tokens is the context, and nodes must state stream limits


@dataclass(frozen=True)
class NodeEvent:
    """A node's state changed (`new` None: forgotten), or a convicted node came back with a new boot id
    and stays quarantined (`old` is `new`). For the operator's log."""

    address: str
    old: NodeState | None
    new: NodeState | None
    reason: str


@dataclass
class NodeRecord:
    address: str
    source: str  # the first hint's kind: "mdns", "static", "dns" or "remembered"
    state: NodeState = NodeState.PENDING
    reason: str = "waiting for Info"
    identity: NodeIdentity | None = None
    advert_family: str | None = None
    # Where we heard of it: "static", "dns", "remembered" or "mdns:<instance>" -> the family that hint
    # claims (None: no claim). Hints decide only whether to look, never what the node is.
    hints: dict[str, str | None] = field(default_factory=dict)
    proven: bool = False  # has proved to be one of ours over its own connection at least once
    checked: bool = False  # at least one health round has looked at it
    consecutive_failures: int = 0
    ewma_ms: float | None = None
    calls_open: int = 0  # hops sent and not answered yet; changed only by begin_call / end_call
    served: int = 0
    failed: int = 0
    state_since: float = 0.0
    recent_ms: deque[float] = field(default_factory=lambda: deque(maxlen=64))  # bounded: for hedging
    # Verification's findings (what was checked, against what, how far off); a node quarantined on
    # evidence stays out for good, and a new incarnation of it only after a cool-down (convictions.py).
    evidence: deque[Evidence] = field(default_factory=lambda: deque(maxlen=5))
    convicted: bool = False  # this incarnation was caught lying
    barred: bool = False  # this incarnation is kept out by an earlier one's conviction

    def latency_quantile(self, q: float, min_samples: int = 8) -> float | None:
        """The q-quantile of recent hop latencies (ms), or None while there are too few to judge."""
        return None if len(self.recent_ms) < min_samples else quantile(self.recent_ms, q)

    @property
    def in_flight(self) -> int:
        return self.calls_open

    def begin_call(self) -> None:
        self.calls_open += 1

    def end_call(self) -> None:
        self.calls_open -= 1

    @property
    def block(self) -> int:
        return -1 if self.identity is None else self.identity.block

    @property
    def routable(self) -> bool:
        return self.state is NodeState.HEALTHY

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    @property
    def mdns_only(self) -> bool:
        return bool(self.hints) and all(h.startswith(MDNS) for h in self.hints)

    def worth_contacting(self, family_id: str) -> bool:
        """Not while every hint we have claims another family (an advert is enough to stay away
        from a stranger, never enough to turn away a node that proved itself)."""
        if self.identity is not None or not self.hints:
            return True
        return any(claim is None or claim == family_id for claim in self.hints.values())

    def score(self) -> float:
        """Lower is better: expected latency inflated by queue depth (for the `fastest` policy)."""
        latency = self.ewma_ms if self.ewma_ms is not None else 1.0
        return latency * (1 + self.in_flight)

    def to_json(self) -> RecordView:
        ident = self.identity
        return {
            "address": self.address,
            "source": self.source,
            "state": self.state.value,
            "reason": self.reason,
            "family_id": ident.family_id if ident else self.advert_family,
            "model_id": ident.model_id if ident else None,
            "block": ident.block if ident else None,
            "variant": ident.variant if ident else None,
            "device": ident.device if ident else None,
            "boot_id": ident.boot_id if ident else None,
            "weights_sha256": ident.weights_sha256 if ident else None,
            "ewma_latency_ms": None if self.ewma_ms is None else round(self.ewma_ms, 3),
            "in_flight": self.in_flight,
            "served": self.served,
            "failed": self.failed,
            "consecutive_failures": self.consecutive_failures,
            "hints": sorted(self.hints),
            "evidence": list(self.evidence),
        }
