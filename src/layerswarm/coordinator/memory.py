"""The coordinator process's heap, kept to its working size over days.

What grew in the 30-minute soaks after warm-up was memory glibc had been given back and kept: its
bytes in use (mallinfo2) and Python's objects stayed flat while its free bytes and RSS rose together,
in the main heap and in a thread's arena (issue 43; docs/chaos.md, "Memory over time"). The process
raises glibc's trim threshold so activations reuse freed pages (wire/memory.py), so glibc itself gives
nothing back, and each thread that allocates under contention (gRPC's, the executor's) may get an
arena of its own whose free space other threads never reuse. So the process asks for few arenas at
start-up (`few_arenas`, as a node does) and `HeapKeeper` hands the arenas' whole free pages back every
`every_s` when there are enough of them: off the event loop (malloc_trim walks every arena holding its
lock, a few ms), and not per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from layerswarm.wire.memory import give_back_free_memory, malloc_usage

log = logging.getLogger(__name__)

TRIM_EVERY_S = 60.0
TRIM_FREE_BYTES = 4 * 1024 * 1024  # less free than this: not worth a walk of the arenas


class HeapKeeper:
    """A background task: every `every_s`, malloc_trim(0) in a worker thread when glibc keeps at least
    `min_free` bytes free. `trims` and `last_error` say what it did (a failure is logged, never fatal)."""

    def __init__(self, every_s: float = TRIM_EVERY_S, min_free: int = TRIM_FREE_BYTES) -> None:
        self.every_s = every_s
        self.min_free = min_free
        self.trims = 0
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="heap-keeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await asyncio.to_thread(self.trim_once)
            except Exception as exc:  # the C library refusing: logged, and the process goes on serving
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("malloc_trim failed; going on")

    def trim_once(self) -> bool:
        """Trim if enough is free (glibc only); True when it did."""
        usage = malloc_usage()
        if usage is None or usage["free"] < self.min_free:
            return False
        give_back_free_memory()
        self.trims += 1
        after = malloc_usage()
        log.debug("heap trimmed: %d bytes free before, %s after", usage["free"], after and after["free"])
        return True
