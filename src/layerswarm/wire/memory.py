"""Keep freed activation buffers in the process instead of handing their pages back to the kernel.

glibc serves a large allocation with fresh pages (mmap) and gives freed memory at the top of its heap
back to the kernel, so every activation a process decodes, casts and encodes pays a page fault per
4 KiB page it touches first. Raising both thresholds keeps those pages for reuse. It shows at large
activations (batch 8 and up: the "codec and checks" rung of `layerswarm bench --only hop`); at batch 1
(302 KB) glibc's own dynamic threshold already reuses them.

The other way round, once: `give_back_free_memory` returns the heap's free pages to the kernel. A decoder
node calls it when many streams' caches were freed (node/decode.py), so a device's memory comes back for
its other programs after a burst of streams instead of staying in this process's heap; the node's guard
calls it after a stranger's flood (node/guard.py), with few arenas (`few_arenas`) so that gRPC's threads
do not keep freed memory in arenas of their own.

`malloc_usage` tells the two kinds of growth apart from outside tracemalloc: bytes malloc has handed out
and not got back (a leak, Python's or native) against free bytes it keeps (retention, fragmentation).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import TypedDict

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
NODE_ARENAS = 2  # measured (bench/grpc_flood.py, 4 connections): +12 to +18 MiB kept after a flood, +5 with 2
LARGEST_REUSED = 32 * 1024 * 1024  # glibc's own ceiling for its dynamic threshold on 64-bit


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_large_buffers(largest: int = LARGEST_REUSED) -> bool:
    """Serve allocations up to `largest` bytes from the heap and keep up to twice that free; True when
    applied (glibc on Linux), False elsewhere (macOS, musl), where the default allocator stays."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # musl (Alpine) has no mallopt
        return False
    applied = bool(mallopt(M_MMAP_THRESHOLD, largest)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * largest))
    log.debug("malloc thresholds raised to %d bytes: %s", largest, applied)
    return applied


def give_back_free_memory() -> bool:
    """glibc's malloc_trim(0): the heap's free pages (its top and whole free pages inside it) go back to
    the kernel. True when it released any; False when nothing was free or the allocator is not glibc's.
    It holds the allocator's lock while it walks the heap (on the 2-core development machine: 4 ms for a
    300 MB heap, 28 ms when it hands back 150 MB of it): call it off the event loop, and not per request."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def few_arenas(arenas: int = NODE_ARENAS) -> bool:
    """At most `arenas` malloc arenas (glibc makes up to 8 a core, one per thread that meets contention):
    gRPC's threads then share a few, and memory a flood freed in them can be given back instead of
    staying behind in partly used ones. Call at start-up, before threads allocate. True when applied."""
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and bool(mallopt(M_ARENA_MAX, arenas))


class MallocUsage(TypedDict):
    """glibc's mallinfo2, summed over every arena: what a process's heap holds, in bytes."""

    in_use: int  # handed out and not freed (uordblks + hblkhd): grows with a leak
    free: int  # freed but kept in the arenas (fordblks): grows with retention and fragmentation
    arenas: int  # bytes the arenas took from the kernel (arena)
    mmapped: int  # large blocks mapped on their own (hblkhd)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_usage() -> MallocUsage | None:
    """The heap's in-use and free bytes (glibc 2.33 and later); None elsewhere. Takes each arena's lock
    briefly: fine once a scrape, not per request."""
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {
        "in_use": int(info.uordblks + info.hblkhd),
        "free": int(info.fordblks),
        "arenas": int(info.arena),
        "mmapped": int(info.hblkhd),
    }
