"""A coroutine run every `interval_s` seconds in the background, cancelled cleanly on stop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class Periodic:
    def __init__(self, name: str, interval_s: float, work: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.interval_s = interval_s
        self.work = work
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.work()
