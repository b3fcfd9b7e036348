"""Bounds on what requests may hold: admission before any body is read, bounded body reads, and size
limits enforced while the body streams in (Content-Length and chunked alike).

Order matters: a request is admitted (or refused with 429) from its headers alone, then waits for
one of a few body-read slots, then its body is read chunk by chunk and refused with 413 the moment
it passes the limit. So held or oversized bodies cost at most `max_body_reads` x the limit in memory,
and nothing is buffered for a request that is refused anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from starlette.requests import Request

from ..metrics import CoordinatorMetrics
from .errors import ApiError

BODY_SLOT_WAIT_S = 1.0  # a legit body reads in milliseconds; waiting longer means slow clients hold every slot


class Gate:
    def __init__(self, max_in_flight: int, max_body_reads: int, metrics: CoordinatorMetrics) -> None:
        self.max_in_flight = max_in_flight
        self.max_body_reads = max_body_reads
        self.in_flight = 0
        self._body_slots = asyncio.Semaphore(max_body_reads)
        self._metrics = metrics

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one of `max_in_flight` places for the whole request, or 429 at once."""
        if self.in_flight >= self.max_in_flight:
            raise ApiError(429, "busy", f"{self.in_flight} requests in flight (limit {self.max_in_flight}); retry")
        self.in_flight += 1
        self._metrics.in_flight.inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            self._metrics.in_flight.dec()

    async def read_body(self, request: Request, limit: int) -> bytes:
        """The whole body, read in a body slot, 413 as soon as it passes `limit` bytes."""
        chunks = []
        async with self.body_slot():
            async for chunk in stream_limited(request, limit):
                chunks.append(chunk)
        return b"".join(chunks)

    @contextlib.asynccontextmanager
    async def body_slot(self) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(self._body_slots.acquire(), BODY_SLOT_WAIT_S)
        except asyncio.TimeoutError as exc:
            raise ApiError(429, "busy", f"{self.max_body_reads} request bodies are being read; retry") from exc
        self._metrics.body_reads.inc()
        try:
            yield
        finally:
            self._body_slots.release()
            self._metrics.body_reads.dec()


async def stream_limited(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    """The body's chunks; ApiError 413 from the declared length, or while streaming once past `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, "too_large", f"request body of {declared} bytes is over the {limit}-byte limit")
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "too_large", f"request body over the {limit}-byte limit")
        yield chunk
