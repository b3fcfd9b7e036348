"""The generation chaos run's load: concurrent streamed completions (`POST /v1/completions`, `stream: true`,
greedy) of held-out task prompts, bounded in count and time by load.bounded_indices, each recorded with
when it started, which prompt it asked and how it ended (harness/streams.py reads the events).

While the load runs, `live()` says which streams are mid-way (their first token came, [DONE] not yet): a
fault is put on the swarm only while some are, so every fault lands mid-stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from layerswarm.harness.streams import StreamResult, Task, stream_one

from .load import bounded_indices

STREAM_TIMEOUT_S = 60.0  # a stream silent this long is cut (and counted as truncated): a few tokens take seconds


@dataclass
class StreamRecord:
    index: int
    prompt: int  # which task (its position in the prompt list)
    sent: float  # monotonic
    result: StreamResult = field(default_factory=StreamResult)
    first: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    ended: bool = False

    @property
    def finished_at(self) -> float:
        return self.sent + self.result.elapsed_s


class StreamLoad:
    """`streams` streams at least, `concurrency` at once, on until `until` is set, never past `max_s`."""

    def __init__(self, url: str, model: str, tasks: Sequence[Task], concurrency: int) -> None:
        self.url, self.model, self.tasks, self.concurrency = url, model, tasks, concurrency
        self.records: list[StreamRecord] = []

    def live(self) -> list[int]:
        """Indices of the streams mid-way now: a first token received, not ended."""
        return [r.index for r in self.records if r.first.is_set() and not r.ended]

    def started_after(self, instant: float) -> list[StreamRecord]:
        return [r for r in self.records if r.sent >= instant]

    async def run(self, streams: int, until: asyncio.Event | None = None, max_s: float = 600.0) -> list[StreamRecord]:
        queue = bounded_indices(streams, until, max_s)
        timeout = httpx.Timeout(STREAM_TIMEOUT_S, connect=10.0)
        limits = httpx.Limits(max_connections=self.concurrency + 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits) as client:

            async def worker() -> None:
                for i in queue:
                    record = StreamRecord(i, i % len(self.tasks), time.monotonic())
                    self.records.append(record)
                    try:
                        await stream_one(client, self.model, self.tasks[record.prompt], record.result, record.first)
                    finally:
                        record.ended = True

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return sorted(self.records, key=lambda r: r.index)
