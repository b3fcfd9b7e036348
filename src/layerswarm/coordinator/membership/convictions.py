"""Convictions outlive the incarnation they caught, so they are kept here, apart from node records.

A node caught lying (verification's evidence) is quarantined. It used to come back as soon as its
Info reported a new boot id, but the boot id is the node's own claim: a hostile device would claim a
new one and be back in rotation after its probation hops (after which only a sample of hops is
re-executed). So each conviction bars its key for a cool-down that doubles with each further
conviction of that key (capped): a new incarnation during it stays quarantined, after it comes back on
probation (verification/verifier.py re-checks every hop of a new boot id). The incarnation that was caught is never
readmitted. Two hops of one incarnation caught together are one offence, not two.

The key is the node's address (HOST:PORT), never its host alone: many honest nodes share a host
(docker-compose). Nodes present no stable identity to key on as well: their trace keys are made per
boot, node certificates share one name (and, without per-device certificates, one key), and gRPC does
not show a client the server's certificate. So a liar that moves to another port escapes its bar, but
only as a newcomer: admitted by the usual rules, on probation.

Not in NodeRecord: a record is dropped when its node is forgotten (no hint left and no answer), and
leaving for a moment must not wipe the slate. Bounded: at most `max_keys` addresses (when full, the one
whose bar ends first goes), and an address's count is forgotten once its bar has been over for the
longest bar. Pure logic on the caller's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

MAX_BAR_S = 24 * 3600.0  # the longest bar, however often one address is convicted
MAX_KEYS = 4096  # addresses remembered; each needed a proven node caught lying to get here


class ConvictionView(TypedDict):
    convictions: int  # offences of the address
    barred_until: float | None  # Unix seconds until which a new incarnation is barred (None: it is not)


@dataclass
class Conviction:
    count: int  # offences (incarnations caught lying) of this key
    boot_id: str  # the incarnation caught last: never readmitted
    bar_s: float  # how long this offence bars a new incarnation
    until: float  # the clock's time at which a new incarnation may come back


class Convictions:
    def __init__(
        self, first_bar_s: float, clock: Callable[[], float], max_bar_s: float = MAX_BAR_S, max_keys: int = MAX_KEYS
    ) -> None:
        self.first_bar_s = first_bar_s
        self.max_bar_s = max(max_bar_s, first_bar_s)
        self.clock = clock
        self.max_keys = max_keys
        self._table: dict[str, Conviction] = {}

    def __len__(self) -> int:
        return len(self._table)

    def bar_s(self, count: int) -> float:
        """The bar of a key's `count`th offence: doubling from the first, capped."""
        return min(self.first_bar_s * 2.0 ** min(count - 1, 64), self.max_bar_s)

    def convict(self, key: str, boot_id: str) -> Conviction:
        now = self.clock()
        self._forget_old(now)
        known = self._table.get(key)
        if known is not None and known.boot_id == boot_id:
            return known  # the same incarnation again (hops in flight when it was caught): one offence
        count = 1 if known is None else known.count + 1
        bar = self.bar_s(count)
        conviction = self._table[key] = Conviction(count, boot_id, bar, now + bar)
        while len(self._table) > self.max_keys:
            del self._table[min(self._table, key=lambda k: self._table[k].until)]
        return conviction

    def get(self, key: str) -> Conviction | None:
        return self._table.get(key)

    def bar(self, key: str, boot_id: str) -> str | None:
        """Why incarnation `boot_id` at `key` may not be admitted now (None: it may)."""
        c = self._table.get(key)
        if c is None:
            return None
        offences = f"convicted of lying {c.count} time{'s' if c.count > 1 else ''}"
        if boot_id == c.boot_id:
            return f"{offences}: this incarnation is never readmitted"
        if self.clock() < c.until:
            return f"{offences}: a new boot id is not readmitted within {c.bar_s:.0f} s of the last conviction"
        return None

    def barred_for_s(self, key: str) -> float | None:
        """Seconds until a new incarnation at `key` may come back (None: it may now)."""
        c = self._table.get(key)
        left = None if c is None else c.until - self.clock()
        return left if left is not None and left > 0 else None

    def view(self, key: str, wall: Callable[[], float]) -> ConvictionView:
        """For /v1/nodes: the key's offences, and until when (`wall` clock: Unix seconds) a new
        incarnation is barred (None: it is not)."""
        c, left = self._table.get(key), self.barred_for_s(key)
        return {
            "convictions": 0 if c is None else c.count,
            "barred_until": None if left is None else round(wall() + left, 3),
        }

    def _forget_old(self, now: float) -> None:
        for key in [k for k, c in self._table.items() if now >= c.until + self.max_bar_s]:
            del self._table[key]
