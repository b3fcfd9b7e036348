"""One stream, one typed record: what was asked, what was generated, where it runs, and what it needs to
keep going when a node fails.

    StreamSession
      id, request_id        the nodes' stream id (128 random bits) and the short id in logs
      prompt, generated     token ids; row j of every hop's log is token j's state
      options, limit        what the caller asked, and how many tokens it may get
      sampling, rng         models/lm/generate.py's Sampling and its seeded generator: same seed, same text
      text                  stops.TextStream: what may be shown, stop sequences
      route                 RouteSlot per position: its block, the node serving it now, how many tokens
                            that node's cache holds for us, and its RowLog of every input it was sent
                            (a lost cache is rebuilt elsewhere by replaying it)
      final                 the head's inputs (where a convicted last hop's replies went)
      holders, links        every node that may hold our cache (all released at the end), and the
                            way to each (decode_links.py)
      dropped               nodes failed or convicted this step: the stream never returns to them, and
                            its caches there are freed when the step ends, not at the stream's end
      trace                 rebuilt / skipped / convicted / hop_failed events, in order
      trips, speculation    trips through the route (the prefill's included), and with speculation on,
                            the draft's counts (SpeculationStats): drafted, accepted, the k last used
      exits                 block-hops (nodes called, every pass) and, with early exit on, its rule and
                            the tokens that left the route early (exits.py)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypedDict

import torch

from layerswarm.models.lm.generate import Sampling

from ..membership.decode_links import StepLink
from ..membership.records import NodeRecord
from .exits import ExitStats, ExitView, exit_view
from .options import OFF, GenerationOptions, Speculation
from .rows import RowLog
from .stops import TextStream


@dataclass(frozen=True)
class Delta:
    """What one sampled token lets the caller see: its text (may be empty: held back, or eos), its id
    (None for eos), and the finish reason once the stream ends (stop | length)."""

    text: str
    token: int | None
    finish_reason: str | None


class TraceEvent(TypedDict, total=False):
    """What happened to a stream's route, in order (the stream's trace, the page, the metrics)."""

    kind: str  # hop_failed | rebuilt | skipped | convicted
    at_token: int  # tokens the stream held when it happened
    position: int
    block: int
    node: str | None  # the node it happened to
    to: str | None  # rebuilt: the node that took the position over
    reason: str
    replayed_tokens: int  # rebuilt: tokens sent to build the new node's cache
    from_row: int  # rebuilt after a lie: the first token whose states were recomputed
    tainted_tokens: int  # convicted: tokens already sampled from the liar's states before it was caught
    ms: float  # rebuilt: how long the rebuild took


class SlotView(TypedDict):
    position: int
    block: int
    node: str | None
    model_id: str | None
    state: str  # ok | rebuilt | skipped
    rebuilds: int


class SpeculationView(TypedDict):
    mode: str  # off | auto | k
    draft_depth: int
    k: int | None  # drafts in the last round
    drafted: int
    accepted: int
    acceptance: float | None  # accepted / drafted
    trips_per_token: float | None  # trips through the route per generated token (plain decoding: 1)


@dataclass
class SpeculationStats:
    ask: Speculation = OFF
    draft_depth: int = 0
    drafted: int = 0
    accepted: int = 0
    k: int | None = None

    def round(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.k = drafted


class StreamView(TypedDict):
    """A stream as the page and the native API's final event show it."""

    id: str
    tokens: int  # generated so far
    prompt_tokens: int
    tokens_per_s: float | None  # generated tokens over the time since the first one
    elapsed_s: float
    route: list[SlotView]
    rebuilt: int
    skipped: int
    finish_reason: str | None
    error: str | None
    trips: int
    speculation: SpeculationView
    early_exit: ExitView


@dataclass
class RouteSlot:
    position: int
    block: int
    inputs: RowLog
    node: NodeRecord | None = None
    held: int = 0  # tokens the node's cache holds for this stream, as its last reply said (0: none)
    since_row: int = 0  # the first token whose output from this node went on down the route
    skipped: bool = False
    rebuilds: int = 0
    previous: str | None = None  # the node that served it before it was left
    left_because: str = "no node served it"

    def leave(self, reason: str) -> None:
        """The node goes: the next hop takes the position over elsewhere (its cache rebuilt from 0)."""
        self.previous = self.node.address if self.node is not None else self.previous
        self.left_because = reason
        self.node, self.held = None, 0

    @property
    def model_id(self) -> str | None:
        ident = self.node.identity if self.node is not None else None
        return ident.model_id if ident is not None else None

    def view(self) -> SlotView:
        state = "skipped" if self.skipped else "rebuilt" if self.rebuilds else "ok"
        address = self.node.address if self.node is not None else None
        return {
            "position": self.position,
            "block": self.block,
            "node": address,
            "model_id": self.model_id,
            "state": state,
            "rebuilds": self.rebuilds,
        }


@dataclass
class StreamSession:
    id: str
    request_id: str
    prompt: list[int]
    options: GenerationOptions
    limit: int
    route: list[RouteSlot]
    final: RowLog
    text: TextStream
    sampling: Sampling
    rng: torch.Generator | None  # None: greedy
    eos_id: int
    generated: list[int] = field(default_factory=list)
    trace: list[TraceEvent] = field(default_factory=list)
    holders: set[str] = field(default_factory=set)
    links: dict[str, StepLink] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)  # nodes dropped this step: freed when it ends (runner)
    failed: set[str] = field(default_factory=set)  # nodes that failed this stream: not tried again
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None  # stop | length, once finished
    error: str | None = None
    closed: bool = False
    trips: int = 0  # passes through the route: the prefill, then one per plain step or verify
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    exits: ExitStats = field(default_factory=ExitStats)  # block-hops, and early exits with them on

    @property
    def length(self) -> int:
        """Tokens of the sequence so far: the prompt and every generated token."""
        return len(self.prompt) + len(self.generated)

    @property
    def active(self) -> list[RouteSlot]:
        return [slot for slot in self.route if not slot.skipped]

    def accept(self, token: int) -> tuple[str, str | None]:
        """A sampled token: the text it lets the caller see, and the finish reason once the stream ends
        (stop: eos or a stop sequence, neither shown; length: the limit)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if token == self.eos_id:
            return self.text.flush(), "stop"
        self.generated.append(token)
        delta, stopped = self.text.push(token)
        if stopped:
            return delta, "stop"
        if len(self.generated) >= self.limit:
            return delta + self.text.flush(), "length"
        return delta, None

    def note(self, event: TraceEvent) -> TraceEvent:
        event.setdefault("at_token", self.length)
        self.trace.append(event)
        return event

    def count(self, kind: str) -> int:
        return sum(1 for e in self.trace if e.get("kind") == kind)

    def tokens_per_s(self, now: float | None = None) -> float | None:
        """Generated tokens per second after the first (the first one's wait is the prefill's)."""
        if self.first_token_at is None or len(self.generated) < 2:
            return None
        end = self.finished_at if self.finished_at is not None else (now or time.monotonic())
        span = end - self.first_token_at
        return round((len(self.generated) - 1) / span, 3) if span > 0 else None

    def view(self, now: float | None = None) -> StreamView:
        now = now or time.monotonic()
        end = self.finished_at if self.finished_at is not None else now
        return {
            "id": self.request_id,
            "tokens": len(self.generated),
            "prompt_tokens": len(self.prompt),
            "tokens_per_s": self.tokens_per_s(now),
            "elapsed_s": round(end - self.created, 3),
            "route": [slot.view() for slot in self.route],
            "rebuilt": self.count("rebuilt"),
            "skipped": self.count("skipped"),
            "finish_reason": self.finish_reason,
            "error": self.error,
            "trips": self.trips,
            "speculation": self.speculation_view(),
            "early_exit": exit_view(self.exits, len(self.generated)),
        }

    def speculation_view(self) -> SpeculationView:
        spec, n = self.speculation, len(self.generated)
        return {
            "mode": spec.ask.describe(),
            "draft_depth": spec.draft_depth,
            "k": spec.k,
            "drafted": spec.drafted,
            "accepted": spec.accepted,
            "acceptance": round(spec.accepted / spec.drafted, 4) if spec.drafted else None,
            "trips_per_token": round(self.trips / n, 4) if n else None,
        }
