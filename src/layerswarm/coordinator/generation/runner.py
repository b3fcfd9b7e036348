"""Moves a step's new tokens through a stream's route, and keeps the stream going when hops fail.

    advance(session, x, row)   the states of tokens row .. row + T - 1, (1, T, D), through every position

Each position's node gets Decode(start, its inputs from start on): start is `row`, or less when the node's
cache holds less, down to 0 on a node that holds nothing, where the position's RowLog (every input it was
ever sent) is replayed: that is how a cache is rebuilt. When a hop fails (decode_call.Failure):

    LOST       rebuild on the same node (it is up; its cache went), once; then as DOWN
    FULL       the same node again after a short backoff (a busy moment passes), a few times; then as DOWN
    others     rebuild on another node of the same block index (routes.choose: our own model, or a
               sibling model's block where the family is shuffle-robust), replaying the inputs
    none left  skip the block for the rest of the stream where the family's evaluated minimum depth
               allows it (routes.may_skip); else the stream fails (StreamFailed)

A node that left the routable set since the last step (ejected by health checks) is rebuilt away from
before it is called. Checks (verification/decode_check.py) run beside the later hops and are awaited
before the step's output is used (lies.py): a failed one convicts the node, and the stream is rewound to the first
token whose state the node falsified (its earlier replies are the next position's stored inputs): a new
node replays that position, and every later one recomputes from that token (Decode's start truncates
their caches to it). A node convicted by another stream is treated the same way when this stream
reaches it. Every event goes into the stream's trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..membership.clients import ClientPool
from ..membership.decode_links import StepLink
from ..membership.records import NodeRecord
from ..membership.registry import Registry
from ..verification.decode_check import DecodeVerifier
from .decode_call import DecodeCaller, DecodeFailed, DecodeReply, Failure
from .exits import ExitCheck, skip_rest
from .lies import Check, Lies, Rewind, drop_link
from .releases import Releases
from .routes import choose, may_skip
from .session import RouteSlot, StreamSession, TraceEvent

log = logging.getLogger(__name__)

MAX_REWINDS = 8  # per step: a swarm of liars cannot keep a stream rewinding for ever
# A node at its limits (RESOURCE_EXHAUSTED) refuses before it touches our cache: a busy moment passes, so
# the same node is asked again (0.02, 0.04, 0.08 s) before the position goes elsewhere.
BUSY_RETRIES = 3
BUSY_BACKOFF_S = 0.01


class StreamFailed(Exception):
    """The stream cannot go on: a block no node can serve and the minimum depth forbids skipping it, or
    too many rewinds. The message says which."""


@dataclass
class _Takeover:
    """A position changing node (or rebuilding on the same one): noted in the trace once it answers."""

    old: str | None
    reason: str
    started: float


@dataclass(frozen=True)
class RouteRules:
    own_model: str  # the coordinator's model: its nodes are preferred
    robust: bool  # shuffle-robust family: a sibling model's block may stand in
    min_depth: int  # blocks a route keeps; a family never evaluated keeps every block
    prefill_chunk: int = 0  # a longer pass goes in pipelined chunks of this many tokens (0: one pass)


class StreamRunner:
    def __init__(
        self,
        calls: DecodeCaller,
        pool: ClientPool,
        registry: Registry,
        verifier: DecodeVerifier | None,
        rules: RouteRules,
        open_streams: Callable[[], Mapping[str, int]],
        releases: Releases,
        on_failover: Callable[[str], None] | None = None,
    ) -> None:
        self.calls = calls
        self.pool = pool
        self.registry = registry
        self.verifier = verifier
        self.rules = rules
        self.open_streams = open_streams
        self.releases = releases
        self.on_failover = on_failover
        self.lies = Lies(verifier, registry, calls.wire)

    async def advance(self, s: StreamSession, x: torch.Tensor, row: int, exit: ExitCheck | None = None) -> torch.Tensor:
        """(1, T, D) states of tokens row .. row + T - 1 through the route; the route's output for them
        (after a rewind, for the tokens from the rewound one: the last row is always the newest token's).
        With `exit`, a single token may leave the route early (exits.py): its state where it left."""
        try:
            return await self._advance(s, x, row, exit)
        finally:
            if s.dropped and not s.closed:  # nodes this step gave up: free the stream's caches there now
                self.releases.free(s.id, s.request_id, s.dropped)
                s.dropped.clear()

    async def _advance(self, s: StreamSession, x: torch.Tensor, row: int, exit: ExitCheck | None) -> torch.Tensor:
        position, rewinds = 0, 0
        while True:
            try:
                chunk = self.rules.prefill_chunk
                if exit is None and 0 < chunk < x.shape[1]:
                    return await self._pipelined(s, position, row, x, chunk)
                return await self._walk(s, position, row, x, exit)
            except Rewind as rewind:
                rewinds += 1
                if rewinds > MAX_REWINDS:
                    raise StreamFailed(f"{rewinds} rewinds in one step: too many nodes failed their checks") from None
                position, row = rewind.position, rewind.row
                x = s.route[position].inputs.rows(row)

    async def _walk(
        self, s: StreamSession, first: int, row: int, x: torch.Tensor, exit: ExitCheck | None
    ) -> torch.Tensor:
        checks: list[Check] = []
        hops = 0
        try:
            for slot in s.route[first:]:
                if slot.skipped:
                    continue
                x = await self._pass(s, slot, row, x, checks)
                hops += 1
                if exit is None:
                    continue
                rest = [later.inputs for later in s.route[slot.position + 1 :] if not later.skipped]
                if await exit.leaves(hops, len(rest), x):
                    skip_rest(rest, row, x)  # their next Decode fills it in (see _hop)
                    s.exits.exits += 1
                    break
            s.exits.block_hops += hops
            s.final.put(row, x)
            await self.lies.confirm(s, checks)
        finally:
            for check in checks:
                check.task.cancel()  # a rewind redoes what they would have confirmed
        return x

    async def _pipelined(self, s: StreamSession, first: int, row: int, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """A long pass (a prompt's prefill) in chunks of `chunk` tokens, each entering a position as soon as
        the chunk before it has left: the route's nodes compute different chunks at once, and one chunk's
        transfer overlaps the others' compute (pipeline parallelism; a lone pass keeps one node busy at a
        time). A node still sees its stream's tokens in order, so its cache grows as for one pass, and a
        failed hop rebuilds from the position's logged inputs as in `_walk`. Checks are confirmed once
        every chunk is through."""
        route = s.route[first:]
        rows = range(row, row + x.shape[1], chunk)
        loop = asyncio.get_running_loop()
        # left[c][i]: chunk c has left the i-th position of `route` (i = len(route): its output is logged)
        left = [[loop.create_future() for _ in range(len(route) + 1)] for _ in rows]
        checks: list[Check] = []

        async def walk(c: int, r: int, xc: torch.Tensor) -> tuple[torch.Tensor, int]:
            hops = 0
            for i, slot in enumerate(route):
                if c:
                    await left[c - 1][i]
                if not slot.skipped:
                    xc = await self._pass(s, slot, r, xc, checks)
                    hops += 1
                left[c][i].set_result(None)
            if c:
                await left[c - 1][len(route)]
            s.final.put(r, xc)
            left[c][len(route)].set_result(None)
            return xc, hops

        tasks = [asyncio.ensure_future(walk(c, r, x[:, r - row : r - row + chunk])) for c, r in enumerate(rows)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]  # the earliest chunk's failure
            outs = [t.result() for t in tasks]
            s.exits.block_hops += outs[-1][1]  # one pass, as `_walk` counts it
            await self.lies.confirm(s, sorted(checks, key=lambda check: (check.slot.position, check.row)))
        finally:
            for task in tasks:
                task.cancel()  # a chunk failed: the others stop where they are (a rebuild resumes them)
            await asyncio.gather(*tasks, return_exceptions=True)  # settled before a rewind walks again
            for check in checks:
                check.task.cancel()  # a rewind redoes what they would have confirmed
        return torch.cat([out for out, _ in outs], dim=1)

    # --- one position ----------------------------------------------------------------------------------

    async def _pass(
        self, s: StreamSession, slot: RouteSlot, row: int, x: torch.Tensor, checks: list[Check]
    ) -> torch.Tensor:
        """Log the position's input for tokens row.., then the hop."""
        if s.closed:  # its client left while the step ran: open nothing new on any node
            raise StreamFailed("the stream was closed")
        x = slot.inputs.put(row, x)
        return await self._hop(s, slot, row, x, checks)

    async def _hop(
        self, s: StreamSession, slot: RouteSlot, row: int, x: torch.Tensor, checks: list[Check]
    ) -> torch.Tensor:
        """The position's output for tokens row.. (x: its input for them, logged already)."""
        takeover: _Takeover | None = None
        lost_once: set[str] = set()
        busy = 0  # refusals of a node at its limits, in a row
        while True:
            record = slot.node
            if record is None or not record.routable:
                if record is not None and record.convicted:
                    await self.lies.convicted_elsewhere(s, slot, record)  # raises Rewind when it falsified ours
                reason = slot.left_because if record is None else f"{record.state.value}: {record.reason}"
                old = record.address if record is not None else slot.previous
                takeover = takeover or _Takeover(old, reason, time.monotonic())
                record = self._take_over(s, slot, reason)
                if record is None:
                    return x  # skipped: the block's input goes on as its output
            start = min(slot.held, row)
            # With early exit, the rows the node lacks before the new ones go as `fill` (keys and values
            # only: exited tokens' states, or a rebuild's replay); else they are replayed as inputs.
            fill_to = row if s.exits.rule is not None else start
            fill = slot.inputs.rows(start, fill_to) if fill_to > start else None
            sent = slot.inputs.rows(fill_to)
            try:
                link = self._link(s, record)
                reply = await self.calls.call(record, link, s.id, s.request_id, start, sent, fill)
            except DecodeFailed as failure:
                if failure.kind is Failure.FULL and busy < BUSY_RETRIES:  # refused before our cache was touched
                    busy += 1
                    await asyncio.sleep(BUSY_BACKOFF_S * 2**busy)
                    continue
                same = failure.kind is Failure.LOST and record.address not in lost_once
                lost_once.add(record.address)
                self._failed(s, slot, record, failure, retry_here=same)
                takeover = takeover or _Takeover(record.address, str(failure), time.monotonic())
                if not same:
                    slot.leave(str(failure))
                continue
            self._answered(s, slot, record, reply, takeover, fill_to - start + sent.shape[1], row)
            if self.verifier is not None and self.verifier.wants(record):
                inputs = slot.inputs.rows()
                task = asyncio.ensure_future(
                    self.verifier.check(record, inputs, reply.out, self.calls.wire, slot.position)
                )
                checks.append(Check(slot, record, task, row))
            return reply.out[:, row - fill_to :]

    def _answered(
        self,
        s: StreamSession,
        slot: RouteSlot,
        record: NodeRecord,
        reply: DecodeReply,
        takeover: _Takeover | None,
        replayed: int,
        row: int,
    ) -> None:
        self.registry.record_success(record.address, reply.latency_ms)
        slot.held = reply.length
        if takeover is None:
            return
        if takeover.old != record.address:
            slot.since_row = row  # outputs before `row` downstream came from the node before it
        slot.rebuilds += 1
        ms = round((time.monotonic() - takeover.started) * 1e3, 3)
        s.note(
            TraceEvent(
                kind="rebuilt",
                position=slot.position,
                block=slot.block,
                node=takeover.old,
                to=record.address,
                reason=takeover.reason,
                replayed_tokens=replayed,
                ms=ms,
            )
        )
        log.info(
            "%s: position %d rebuilt on %s (%d tokens replayed)", s.request_id, slot.position, record.address, replayed
        )
        if self.on_failover is not None:
            self.on_failover("rebuilt")

    def _failed(
        self, s: StreamSession, slot: RouteSlot, record: NodeRecord, failure: DecodeFailed, retry_here: bool
    ) -> None:
        slot.held = 0  # whatever it held for us is gone or unknown: it is rebuilt with start 0
        s.note(
            TraceEvent(
                kind="hop_failed", position=slot.position, block=slot.block, node=record.address, reason=str(failure)
            )
        )
        log.info("%s: position %d on %s failed: %s", s.request_id, slot.position, record.address, failure)
        if failure.kind is Failure.MALFORMED:
            self.registry.quarantine(record.address, str(failure), failure.evidence)
        elif failure.kind in (Failure.DOWN, Failure.REFUSED):
            self.registry.record_failure(record.address, str(failure))
        if not retry_here:
            s.failed.add(record.address)
            drop_link(s, record.address)

    def _take_over(self, s: StreamSession, slot: RouteSlot, reason: str) -> NodeRecord | None:
        """Another node for the position (its cache rebuilt from the inputs on its first call), or None
        when the block was skipped. Raises StreamFailed when neither is allowed."""
        rules = self.rules
        candidates = self.registry.routable_by_block().get(slot.block, [])
        record = choose(candidates, rules.own_model, rules.robust, self.open_streams(), s.failed)
        if record is not None:
            slot.node, slot.held = record, 0
            return record
        if not may_skip(len(s.active), rules.min_depth):
            raise StreamFailed(
                f"block {slot.block} has no node left to serve it ({reason}), and skipping it would leave "
                f"{len(s.active) - 1} blocks, under the minimum depth of {rules.min_depth}"
            )
        slot.skipped, slot.node = True, None
        s.note(TraceEvent(kind="skipped", position=slot.position, block=slot.block, reason=reason))
        log.info("%s: block %d skipped for the rest of the stream (%s)", s.request_id, slot.block, reason)
        if self.on_failover is not None:
            self.on_failover("skipped")
        return None

    def _link(self, s: StreamSession, record: NodeRecord) -> StepLink:
        link = s.links.get(record.address)
        if link is None:
            link = s.links[record.address] = self.pool.get(record.address).decode_link()
        s.holders.add(record.address)
        return link
