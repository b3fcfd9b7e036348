"""Release calls under way: a stream's caches freed on its nodes, each in a task of its own.

A task, because a release is asked for where nothing may wait: in a response the client cancelled, or
from the step that dropped a failed node. Two moments free caches: the end of a stream (every node that
may hold it) and the step a node is dropped from a stream (failed or convicted: the stream never routes
to it again, so its cache there is freed at once rather than held to the end, still counted against the
node's limits). A node that is down holds nothing: its refusal is logged, not raised."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc

from ..membership.clients import ClientPool

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 2.0


class Releases:
    def __init__(self, pool: ClientPool, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def free(self, stream_id: str, request_id: str, addresses: Iterable[str]) -> None:
        """Ask each node to free the stream (in the background)."""
        work = self._release(stream_id, request_id, sorted(addresses))
        task = asyncio.get_running_loop().create_task(work, name=f"release {request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _release(self, stream_id: str, request_id: str, addresses: list[str]) -> None:
        async def one(address: str) -> None:
            try:
                await self.pool.get(address).release([stream_id], self.timeout_s)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:  # a dead node holds nothing
                log.debug("%s: release on %s: %s", request_id, address, exc)

        await asyncio.gather(*(one(address) for address in addresses))

    async def wait(self, timeout: float | None = None) -> None:
        """Wait (bounded) for the releases under way."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.timeout_s + 1 if timeout is None else timeout)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("releasing a stream failed", exc_info=task.exception())
