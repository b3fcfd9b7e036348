"""What a stream does about a node caught lying (docs/generation-coordinator.md): the step's checks are
awaited in route order, and the first failed one convicts the node and rewinds the stream to the first
token whose state it falsified (its earlier replies are the next position's stored inputs, held against
the coordinator's verified copy of the block). A node convicted by another stream is searched the same way
when this stream reaches it. The runner (runner.py) catches Rewind and walks again from there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from ..membership.records import Evidence, NodeRecord
from ..membership.registry import Registry
from ..verification.decode_check import DecodeVerifier
from .rows import RowLog
from .session import RouteSlot, StreamSession, TraceEvent


class Rewind(Exception):
    def __init__(self, position: int, row: int) -> None:
        super().__init__(f"rewind to position {position}, token {row}")
        self.position = position
        self.row = row


@dataclass
class Check:
    """A hop's reply being re-executed beside the later hops."""

    slot: RouteSlot
    record: NodeRecord
    task: asyncio.Future[Evidence | None]
    row: int


def drop_link(s: StreamSession, address: str) -> None:
    """The stream is done with this node (it is in `s.failed`): end the link, and have its cache there
    freed when the step ends (StreamRunner.advance), not at the stream's end."""
    link = s.links.pop(address, None)
    if link is not None:
        link.close()
    if address in s.holders:
        s.holders.discard(address)
        s.dropped.add(address)


class Lies:
    def __init__(self, verifier: DecodeVerifier | None, registry: Registry, wire: torch.dtype) -> None:
        self.verifier = verifier
        self.registry = registry
        self.wire = wire

    async def confirm(self, s: StreamSession, checks: list[Check]) -> None:
        """Wait for the step's checks, in route order; the first failed one rewinds the stream."""
        for check in checks:
            evidence = await check.task
            if evidence is None:
                continue
            assert self.verifier is not None
            evidence = self.verifier.convict(check.record, evidence)
            self.registry.quarantine(check.record.address, f"verification failed: {evidence['check']}", evidence)
            raise await self.rewind_from(
                s, check.slot, check.record, check.row, f"caught lying: {evidence['discrepancy']}"
            )

    async def convicted_elsewhere(self, s: StreamSession, slot: RouteSlot, record: NodeRecord) -> None:
        """A node another stream convicted: rewind when its replies to this stream were false too."""
        if self.verifier is None or slot.held == 0:
            return
        bad = await self.first_bad_row(s, slot, record)
        if bad is not None:
            raise await self.rewind_from(s, slot, record, bad, "convicted by another stream's check")

    async def rewind_from(self, s: StreamSession, slot: RouteSlot, record: NodeRecord, row: int, reason: str) -> Rewind:
        """The rewind past a liar at `slot`: from the first token it falsified (`row` when none earlier)."""
        found = await self.first_bad_row(s, slot, record)
        first = min(row, found) if found is not None else row
        sampled_until = s.length - 1  # rows before it were sampled from (the newest row's token is still to come)
        tainted = max(0, sampled_until - max(first, len(s.prompt) - 1))
        s.note(
            TraceEvent(
                kind="convicted",
                position=slot.position,
                block=slot.block,
                node=record.address,
                reason=reason,
                from_row=first,
                tainted_tokens=tainted,
            )
        )
        s.failed.add(record.address)
        drop_link(s, record.address)
        slot.leave(reason)
        return Rewind(slot.position, first)

    async def first_bad_row(self, s: StreamSession, slot: RouteSlot, record: NodeRecord) -> int | None:
        """Where the node's earlier replies to this stream went (the next position's inputs, or the
        head's), held against the reference: the first token it falsified, from when it took the
        position over."""
        assert self.verifier is not None and record.identity is not None
        downstream = self.downstream(s, slot)
        n = min(slot.inputs.length, downstream.length)
        if n <= slot.since_row:
            return None
        ident = record.identity
        return await self.verifier.first_bad_row(
            ident.model_id, ident.block, slot.inputs.rows(0, n), downstream.rows(0, n), slot.since_row, self.wire
        )

    @staticmethod
    def downstream(s: StreamSession, slot: RouteSlot) -> RowLog:
        """The next position's inputs (skipped or not: its log holds what this one sent it until then)."""
        later = s.route[slot.position + 1 :]
        return later[0].inputs if later else s.final
