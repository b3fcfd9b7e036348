"""What relay nodes claimed about the node after them, and how the coordinator's checks turned out.

A hand-back names the next node of a chain as failed (docs/relay.md, "When a node fails"), and nothing
in it proves that: a hostile node could name an honest successor on every chain and have it ejected.
So a hand-back never counts against the node it names; the coordinator tries the claim itself (it
forwards the handed-back activation to that node: relay/handbacks.py) and the outcome counts for the node
that made the claim: confirmed (the named node did not answer the coordinator in time either) or
contradicted (it did).

Some hand-backs show that one of two adjacent nodes lied without saying which: a node signed that it
was given a deadline or hop timeout shorter than the chain can have given (handbacks.given_times_problem:
it lies, or the node before it shortened them), or the named node had already run the step for that
request (another node of the chain raced it there). No honest chain produces either, and neither node
can be blamed alone, so the pair is `disputed`: for `bar_s` the two are never adjacent in a chain
again, and nobody's standing changes. Striking both instead let several liars bar an honest neighbour
none of them was barred for.

A node whose claims are contradicted `strikes` times in a row may only end chains for `bar_s`: the
last step of a chain forwards to nobody, so it has nobody to hand back against, and its hop is still
relayed. That bounds what a framing node gets: `strikes` avoided successors and probes per bar, then
nothing, while the cost to an honest node wrongly barred (one behind a node that fails chains yet
serves star calls) is a cut chain, never a failure or an ejection.

Kept apart from NodeRecord, like convictions: a record is dropped when its node is forgotten, and
leaving for a moment must not wipe a streak. Bounded: at most `max_keys` addresses (when full, the one
whose bar ended first goes). Pure logic on the caller's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

STRIKES = 3  # contradicted hand-backs in a row before a node may only end chains
CHAIN_END_ONLY_S = 300.0  # how long it then may only end chains
MAX_KEYS = 4096  # addresses remembered: each made a hand-back the coordinator checked


class ClaimsView(TypedDict):
    handbacks_confirmed: int
    handbacks_contradicted: int
    handbacks_disputed: int
    handbacks_contradicted_in_a_row: int
    chain_end_only_until: float | None  # Unix seconds until which it may only end chains (None: it may forward)


@dataclass
class Tally:
    confirmed: int = 0  # claims the coordinator's own probe agreed with
    contradicted: int = 0  # claims against a node that answered the coordinator's probe
    disputed: int = 0  # disputes it was one side of (this node or its neighbour lied)
    in_a_row: int = 0  # contradicted since the last confirmed claim or the last bar
    until: float = float("-inf")  # the clock's time before which the node may only end chains


class Claims:
    def __init__(
        self,
        clock: Callable[[], float],
        strikes: int = STRIKES,
        bar_s: float = CHAIN_END_ONLY_S,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.clock = clock
        self.strikes = strikes
        self.bar_s = bar_s
        self.max_keys = max_keys
        self._table: dict[str, Tally] = {}
        self._apart: dict[tuple[str, str], float] = {}  # (node, next node) -> until when never adjacent

    def __len__(self) -> int:
        return len(self._table)

    def confirmed(self, address: str) -> None:
        tally = self._tally(address)
        tally.confirmed += 1
        tally.in_a_row = 0

    def contradicted(self, address: str) -> bool:
        """Count a claim of `address` that the coordinator's probe contradicted. True when this one
        makes it a node that may only end chains (the caller logs it)."""
        tally = self._tally(address)
        tally.contradicted += 1
        return self._strike(tally)

    def disputed(self, before: str, after: str) -> None:
        """One of `before` and `after` (adjacent in a chain, in that order) lied; the coordinator cannot
        tell which: they are not chained next to each other for `bar_s`."""
        for address in (before, after):
            self._tally(address).disputed += 1
        now = self.clock()
        self._apart = {pair: until for pair, until in self._apart.items() if until > now}
        while len(self._apart) >= self.max_keys:  # full: the pair whose parting ends first goes
            del self._apart[min(self._apart, key=self._apart.__getitem__)]
        self._apart[(before, after)] = now + self.bar_s

    def may_follow(self, before: str, after: str) -> bool:
        """Whether `after` may be the step right after `before` in a chain."""
        return self._apart.get((before, after), float("-inf")) <= self.clock()

    def _strike(self, tally: Tally) -> bool:
        tally.in_a_row += 1
        if tally.in_a_row < self.strikes:
            return False
        tally.in_a_row = 0  # a fresh count once the bar is over
        tally.until = self.clock() + self.bar_s
        return True

    def may_forward(self, address: str) -> bool:
        """Whether `address` may sit before another step of a chain (else it may only end one)."""
        tally = self._table.get(address)
        return tally is None or self.clock() >= tally.until

    def get(self, address: str) -> Tally | None:
        return self._table.get(address)

    def view(self, address: str, wall: Callable[[], float]) -> ClaimsView:
        """For /v1/nodes: the address's hand-backs by how they turned out, and until when (`wall`
        clock: Unix seconds) it may only end chains (None: it may forward)."""
        tally = self._table.get(address) or Tally()
        left = tally.until - self.clock()
        return {
            "handbacks_confirmed": tally.confirmed,
            "handbacks_contradicted": tally.contradicted,
            "handbacks_disputed": tally.disputed,
            "handbacks_contradicted_in_a_row": tally.in_a_row,  # disputes are no strikes
            "chain_end_only_until": round(wall() + left, 3) if left > 0 else None,
        }

    def _tally(self, address: str) -> Tally:
        tally = self._table.get(address)
        if tally is None:
            while len(self._table) >= self.max_keys:  # full: the one whose bar ended first (or never began) goes
                del self._table[min(self._table, key=lambda k: self._table[k].until)]
            tally = self._table[address] = Tally()
        return tally
