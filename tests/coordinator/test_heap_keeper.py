"""The coordinator's heap keeper (coordinator/memory.py): with the allocator settings the coordinator runs
under (raised trim threshold, few arenas), memory a burst of activations freed stays resident until the
keeper's trim, and goes back to the kernel after it. Run in a child process so that this one's
allocator settings are not changed. Without the trim (a keeper that never trims) the RSS stays up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from layerswarm.wire.memory import malloc_usage

CHILD = """
import asyncio, json
from layerswarm.coordinator.memory import HeapKeeper
from layerswarm.wire.memory import few_arenas, keep_large_buffers

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))

keep_large_buffers()
few_arenas()
base = rss_kib()
# 200 activations of 300 KB served from the heap (the raised mmap threshold), then all but the last
# freed: glibc keeps them (the raised trim threshold), behind the one still in use.
buffers = [bytearray(300_000) for _ in range(200)]
last = buffers[-1]
del buffers
kept = rss_kib()

async def main():
    keeper = HeapKeeper(every_s=0.2, min_free=1 << 20)
    keeper.start()
    await asyncio.sleep(1.0)
    await keeper.stop()
    return keeper.trims

trims = asyncio.run(main()) if TRIM else 0
print(json.dumps({"base": base, "kept": kept, "after": rss_kib(), "trims": trims, "last": len(last)}))
"""


def _run(trim: bool) -> dict[str, int]:
    code = f"TRIM = {trim}\n{CHILD}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module", autouse=True)
def _glibc() -> None:
    if malloc_usage() is None:
        pytest.skip("glibc 2.33+ only (mallinfo2, malloc_trim)")


def test_freed_activations_stay_resident_without_a_trim() -> None:
    kept = _run(trim=False)
    assert kept["kept"] - kept["base"] > 40_000  # 60 MB of buffers, freed, still resident
    assert kept["after"] - kept["base"] > 40_000


def test_the_keeper_gives_them_back() -> None:
    trimmed = _run(trim=True)
    assert trimmed["kept"] - trimmed["base"] > 40_000
    assert trimmed["trims"] >= 2  # it runs on its own, every every_s, while memory is free
    assert trimmed["after"] - trimmed["base"] < 10_000  # back to about where it started
