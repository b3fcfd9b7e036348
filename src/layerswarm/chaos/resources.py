"""What a long run samples of each coordinator process, and whether it stayed flat.

From /proc: resident memory (VmRSS) and open descriptors, and of those how many are HTTP connections
clients had open to it at that moment (with a fresh connection per request, 0 to the load's concurrency)
and how many are its connections to nodes (two channels per live node: they follow the swarm's churn).
`fds_held` is the rest, the process's own: files, listeners, mDNS sockets, event loop and gRPC
descriptors. The verdict is on all open files, as the target says; the parts say where a change came from
(few, so one socket is several percent of `fds_held`). From its /metrics: Python's small-object blocks and
glibc's heap in use and free (coordinator/metrics.py), which tell a leak (in use rising) from the
allocator keeping freed memory (free rising) when RSS moves.

The check (issue 43): from minute 5 (warm-up over) to the end, the largest value stays within 3% of the
minute-5 value."""

from __future__ import annotations

import os
from typing import Any, TypedDict

import httpx
from prometheus_client.parser import text_string_to_metric_families

FLAT_FROM_S = 300.0  # warm-up: caches, arenas and channels fill in the first minutes
FLAT_WITHIN_PCT = 3.0
FLAT_KEYS = ("rss_kib", "fds")  # the issue's "RSS and open files"; the descriptors' parts are reported
TCP_LISTEN = "0A"  # /proc/net/tcp's state column


class Flatness(TypedDict):
    key: str
    from_s: float | None  # the sample taken as the baseline (the first at or after FLAT_FROM_S)
    baseline: float | None
    max: float | None
    end: float | None
    max_drift_pct: float | None  # (max - baseline) / baseline
    end_drift_pct: float | None
    flat: bool | None  # None: the run ended before minute 5


def proc_resources(pid: int, http_port: int | None = None, node_port: int | None = None) -> dict[str, Any] | None:
    """Resident memory (VmRSS, KiB) and open descriptors of a live process, from /proc; with `http_port`
    and `node_port`, also how many of them are inbound connections on the one and outbound to the other."""
    try:
        with open(f"/proc/{pid}/status") as status:
            rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        links = [_link(pid, fd) for fd in os.listdir(f"/proc/{pid}/fd")]
        sample: dict[str, Any] = {"pid": pid, "rss_kib": rss, "fds": len(links)}
        if http_port is not None and node_port is not None:
            inbound, outbound = _connections(pid, http_port, node_port)
            sample["http_clients"] = sum(1 for link in links if link in inbound)
            sample["node_connections"] = sum(1 for link in links if link in outbound)
            sample["fds_held"] = len(links) - sample["http_clients"] - sample["node_connections"]
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None  # gone (killed by the churn), or a zombie
    return sample


def _link(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except FileNotFoundError:  # closed between the listing and the read
        return ""


def _connections(pid: int, http_port: int, node_port: int) -> tuple[set[str], set[str]]:
    """`socket:[inode]` of the connections accepted on `http_port` (not the listener) and of those to
    `node_port` elsewhere, in `pid`'s network namespace (/proc/PID/net/tcp)."""
    inbound: set[str] = set()
    outbound: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as rows:
                next(rows)  # the header
                for row in rows:
                    cols = row.split()
                    local_port, remote_port = (int(c.rsplit(":", 1)[1], 16) for c in cols[1:3])
                    if local_port == http_port and cols[3] != TCP_LISTEN:
                        inbound.add(f"socket:[{cols[9]}]")
                    elif remote_port == node_port:
                        outbound.add(f"socket:[{cols[9]}]")
        except FileNotFoundError:
            continue
    return inbound, outbound


def heap_metrics(url: str, timeout_s: float = 5.0) -> dict[str, int] | None:
    """The coordinator's own view of its memory, from GET /metrics; None when it did not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=timeout_s).text
    except httpx.HTTPError:
        return None
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "layerswarm_python_blocks":
                out["python_blocks"] = int(sample.value)
            elif sample.name == "layerswarm_malloc_bytes":
                out[f"malloc_{sample.labels['kind']}_kib"] = int(sample.value) // 1024
    return out


def coordinator_sample(pid: int, url: str, http_port: int, node_port: int) -> dict[str, Any] | None:
    sample = proc_resources(pid, http_port, node_port)
    if sample is not None:
        sample.update(heap_metrics(url) or {})
    return sample


def flatness(samples: list[dict[str, Any]], key: str, from_s: float = FLAT_FROM_S) -> Flatness:
    """Whether `key` of these samples ({"at_s": .., key: ..}, in time order; None entries skipped)
    stayed within FLAT_WITHIN_PCT of its value at `from_s` up to the end: the largest value is compared."""
    timed = [(s["at_s"], s[key]) for s in samples if s is not None and s.get(key) is not None]
    after = [(at, v) for at, v in timed if at >= from_s]
    if not after or after[0][1] <= 0:
        return {
            "key": key,
            "from_s": None,
            "baseline": None,
            "max": None,
            "end": None,
            "max_drift_pct": None,
            "end_drift_pct": None,
            "flat": None,
        }
    (at0, base), end = after[0], after[-1][1]
    top = max(v for _, v in after)
    drift, end_drift = 100.0 * (top - base) / base, 100.0 * (end - base) / base
    return {
        "key": key,
        "from_s": at0,
        "baseline": base,
        "max": top,
        "end": end,
        "max_drift_pct": round(drift, 2),
        "end_drift_pct": round(end_drift, 2),
        "flat": drift <= FLAT_WITHIN_PCT,
    }
