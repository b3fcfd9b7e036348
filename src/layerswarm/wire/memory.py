"""Keep freed activation buffers in the process instead of handing their pages back to the kernel.

glibc serves a large allocation with fresh pages (mmap) and gives freed memory at the top of its heap
back to the kernel, so every activation a process decodes, casts and encodes pays a page fault per
4 KiB page it touches first. Raising both thresholds keeps those pages for reuse. It shows at large
activations (batch 8 and up: the "codec and checks" rung of `layerswarm bench --only hop`); at batch 1
(302 KB) glibc's own dynamic threshold already reuses them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
NODE_ARENAS = 2  # measured (bench/grpc_flood.py, 4 connections): +12 to +18 MiB kept after a flood, +5 with 2
LARGEST_REUSED = 32 * 1024 * 1024  # glibc's own ceiling for its dynamic threshold on 64-bit


def keep_large_buffers(largest: int = LARGEST_REUSED) -> bool:
    """Serve allocations up to `largest` bytes from the heap and keep up to twice that free; True when
    applied (glibc on Linux), False elsewhere (macOS, musl), where the default allocator stays."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:  # not glibc on Linux: musl (Alpine) has no mallopt
        return False
    applied = bool(mallopt(M_MMAP_THRESHOLD, largest)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * largest))
    log.debug("malloc thresholds raised to %d bytes: %s", largest, applied)
    return applied


def few_arenas(arenas: int = NODE_ARENAS) -> bool:
    """At most `arenas` malloc arenas (glibc makes up to 8 a core, one per thread that meets contention):
    gRPC's threads then share a few, and memory a flood freed in them can be given back instead of
    staying behind in partly used ones. Call at start-up, before threads allocate. True when applied."""
    mallopt = _libc_function("mallopt")
    return mallopt is not None and bool(mallopt(M_ARENA_MAX, arenas))


def release_free_memory() -> bool:
    """Hand the pages of freed memory back to the kernel, in every malloc arena (glibc's malloc_trim(0));
    True when glibc did so. Freed memory otherwise stays with the process (thresholds raised above, and
    gRPC's threads allocating in arenas of their own): after a stranger's flood a node stayed hundreds
    of MiB larger (docs/trust.md, the gRPC flood). False where there is no malloc_trim (macOS, musl)."""
    trim = _libc_function("malloc_trim")
    return trim is not None and bool(trim(0))


def _libc_function(name: str) -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, name, None)
