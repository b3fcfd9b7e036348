"""Chain results a last node keeps for the coordinator's Collect (which may arrive before them).

Every node of a chain holds the chain, MAC and all, so any of them can run a later step first, on the
step's node, with an input of its own: that node cannot tell such a run from the chain's own. When it
kept only the first result for a request id, the coordinator collected the early one, its digest was
not the one the node signed for the chain's run, and the honest node was failed for it. So a node
keeps each result it made for a request id, a few at most (`PER_REQUEST`; runs past that are refused
before they compute, never evicting one kept), until it expires (a Collect takes a copy: see `take`),
and the coordinator, when the first it collects is not the one the trace names, collects again by
digest (coordinator/relay/chains.py). Filling the slots before the chain arrives gets the chain's own run
refused (`ALREADY_EXISTS`): the coordinator takes its predecessor's hand-back for a dispute between the
two, never a failure (coordinator/membership/claims.py).

Bounded: at most `MAX_RESULTS` runs kept or computing, each for at most `TTL_S`. A run past that is
refused, never one kept evicted: a node replaying old chains could otherwise push out the result a
chain's last node had just signed for.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from layerswarm.wire.relay_plan import digest
from layerswarm.wire.v1 import block_pb2 as pb

MAX_RESULTS = 256  # runs kept for Collect or computing, all request ids together
PER_REQUEST = 4  # runs of one request id's last step kept (the chain's and a racer's few)
MAX_WAITING = 256  # Collects waiting at once for a result not kept yet
TTL_S = 30.0


class OutboxFull(Exception):
    """This request id has had its share of runs here, or the outbox is full: refused before computing."""


@dataclass
class _Slot:
    created: float
    results: list[pb.ForwardResponse] = field(default_factory=list)
    runs: int = 0  # reserved: results, and runs still computing

    def find(self, sha256: str) -> pb.ForwardResponse | None:
        """The first result, or with `sha256` the one whose activations have that digest."""
        return next((r for r in self.results if not sha256 or digest(r.activations.data) == sha256), None)


class Outbox:
    def __init__(self) -> None:
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self._waiting = 0  # Collects waiting for a result not kept yet
        self._changed: asyncio.Future[None] | None = None  # woken on every result kept

    def reserve(self, request_id: str) -> None:
        """Count one more run of `request_id`'s last step here; OutboxFull past `PER_REQUEST`."""
        self._expire(time.monotonic())
        runs = sum(s.runs for s in self._slots.values())
        if runs >= MAX_RESULTS:
            raise OutboxFull(f"outbox full: {runs} results kept for Collect or computing")
        slot = self._slot(request_id)
        if slot.runs >= PER_REQUEST:
            raise OutboxFull(f"request {request_id!r} already ran here {slot.runs} times")
        slot.runs += 1

    def put(self, request_id: str, reply: pb.ForwardResponse) -> None:
        self._expire(time.monotonic())
        self._slot(request_id).results.append(reply)
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    async def take(self, request_id: str, timeout: float, sha256: str = "") -> pb.ForwardResponse | None:
        """The first result kept for `request_id` (or, with `sha256`, the one with that digest), once
        there is one, within `timeout`; None if none came, or when `MAX_WAITING` Collects already wait.

        A result stays kept until it expires: any token holder may call Collect, and a take that
        removed it would let a node of the chain take the chain's result before the coordinator could.
        A take never makes a slot (only a run of the step does), so Collects for made-up request ids
        cannot push a chain's result out; they can only fill the waiting places, and the coordinator,
        refused one, collects again by digest once the chain's result is kept (coordinator/relay/chains.py)."""
        end = time.monotonic() + timeout
        while (found := self._find(request_id, sha256)) is None:
            left = end - time.monotonic()
            if left <= 0 or self._waiting >= MAX_WAITING:
                return None
            if self._changed is None or self._changed.done():
                self._changed = asyncio.get_running_loop().create_future()
            self._waiting += 1
            try:
                await asyncio.wait_for(asyncio.shield(self._changed), left)
            except asyncio.TimeoutError:
                return None
            finally:
                self._waiting -= 1
        return found

    def _find(self, request_id: str, sha256: str) -> pb.ForwardResponse | None:
        slot = self._slots.get(request_id)
        return None if slot is None else slot.find(sha256)

    def _slot(self, request_id: str) -> _Slot:
        now = time.monotonic()
        slot = self._slots.get(request_id)
        if slot is None:
            slot = self._slots[request_id] = _Slot(now)
        return slot

    def _expire(self, now: float) -> None:
        while self._slots and now - next(iter(self._slots.values())).created >= TTL_S:
            self._slots.popitem(last=False)
