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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

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
