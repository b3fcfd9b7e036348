"""The coordinator process's heap: few arenas, and what they keep free handed back.

Where the coordinator's RSS went after warm-up in the 30-minute soak (issue 43; docs/chaos.md, "Memory
over time"): into glibc's heap, the main one and one thread arena (/proc/PID/smaps), about two thirds
as bytes in use and one third as freed bytes glibc kept (mallinfo2), while Python's small objects
stayed flat. The process raises glibc's trim threshold so activations reuse freed pages
(wire/memory.py), so glibc itself gives nothing back, and each thread allocating under contention
(gRPC's, the executor's) may get an arena whose free space other threads never reuse. So the process
asks for few arenas at start-up (`few_arenas`, as a node does), and `HeapKeeper` caps what they keep:
every `every_s`, when at least `min_free` bytes are free, their whole free pages go back to the kernel,
off the event loop (malloc_trim walks the arenas under their locks, a few ms) and never per request.
The bytes in use it cannot touch (what grew there: the verifier's reference blocks, loaded on first use
and bounded by the family)."""

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
