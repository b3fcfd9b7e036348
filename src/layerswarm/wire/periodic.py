"""A coroutine run every `interval_s` seconds in the background, cancelled cleanly on stop.

A background loop that dies silently takes a whole duty with it (a node's idle-stream sweep, a
coordinator's health checks) for the life of the process, so every round's error is logged with its
traceback and the loop goes on. Shared by node and coordinator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, name: str, interval_s: float, work: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.interval_s = interval_s
        self.work = work
        self.rounds = 0  # completed without error
        self.errors = 0  # rounds that raised (logged, then the loop went on)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        (outcome,) = await asyncio.gather(self._task, return_exceptions=True)
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            log.error("background loop %s had ended with an error", self.name, exc_info=outcome)
        self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.run_once()

    async def run_once(self) -> None:
        """One round; any error but cancellation is logged and swallowed, so the next round runs."""
        try:
            await self.work()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug or an unexpected library error must not end the duty
            self.errors += 1
            log.exception("background loop %s: round failed; retrying in %.1f s", self.name, self.interval_s)
        else:
            self.rounds += 1
