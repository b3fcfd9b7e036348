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
import logging

from layerswarm.wire.memory import give_back_free_memory, malloc_usage
from layerswarm.wire.periodic import Periodic

log = logging.getLogger(__name__)

TRIM_EVERY_S = 60.0
TRIM_FREE_BYTES = 4 * 1024 * 1024  # less free than this: not worth a walk of the arenas


class HeapKeeper:
    """A background loop (wire/periodic.py: a failed round is logged, the next one runs): every
    `every_s`, malloc_trim(0) in a worker thread when glibc keeps at least `min_free` bytes free."""

    def __init__(self, every_s: float = TRIM_EVERY_S, min_free: int = TRIM_FREE_BYTES) -> None:
        self.min_free = min_free
        self.trims = 0
        self.loop = Periodic("heap-keeper", every_s, self._round)

    def start(self) -> None:
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()

    async def _round(self) -> None:
        await asyncio.to_thread(self.trim_once)

    def trim_once(self) -> bool:
        """Trim if enough is free (glibc only); True when it did."""
        usage = malloc_usage()
        if usage is None or usage["free"] < self.min_free:
            return False
        give_back_free_memory()
        self.trims += 1
        log.debug("heap trimmed with %d bytes free in the arenas", usage["free"])
        return True
