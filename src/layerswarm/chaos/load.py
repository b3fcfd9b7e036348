"""A bounded load generator that records every request: status, latency, trace, prediction.

A request that could not connect, or whose connection a shutting-down coordinator closed before
sending any response, was never processed: it is retried until its deadline (counted as a connect
retry). Anything else that does not end in an HTTP answer is counted as lost.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Record:
    index: int
    sent: float
    latency_s: float
    status: int | None  # None: no HTTP answer (lost)
    error: str | None = None  # the JSON error code, or why it was lost
    correct: bool | None = None
    depth: int | None = None
    hops: dict[str, int] = field(default_factory=dict)  # outcome -> count
    connect_retries: int = 0
    nodes: list[str] = field(default_factory=list)  # the answer's hops' node addresses, in order
    tried: list[str] = field(default_factory=list)  # coordinators sent to, in order (failover: one each)


def bounded_indices(requests: int, until: asyncio.Event | None, max_s: float) -> Iterator[int]:
    """Request indices for the workers to share: at least `requests`, on until `until` is set, never past
    `max_s` seconds from the first one taken."""
    started = time.monotonic()
    for i in itertools.count():
        if time.monotonic() - started > max_s or (i >= requests and (until is None or until.is_set())):
            return
        yield i


async def run_load(
    url: str,
    samples: Sequence[tuple[bytes, str]],
    requests: int,
    concurrency: int,
    deadline_s: float,
    until: asyncio.Event | None = None,
    max_s: float = 600.0,
    records: list[Record] | None = None,
    connect_patience_s: float | None = None,
) -> list[Record]:
    """At least `requests` requests, and on until `until` is set (the fault schedule is done), but never
    longer than `max_s`: bounded in count and time. `records`, if given, fills as answers come (so a
    schedule can wait for a number of requests). A client whose connection is refused retries for
    `connect_patience_s` (default: the deadline) before the request counts as lost."""
    patience = deadline_s if connect_patience_s is None else connect_patience_s
    records = [] if records is None else records
    queue = bounded_indices(requests, until, max_s)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)  # a fresh connection each
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=deadline_s + 5) as client:

        async def worker() -> None:
            for i in queue:
                image, label = samples[i % len(samples)]
                records.append(await one_request(client, i, image, label, patience))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


async def one_request(
    client: httpx.AsyncClient, index: int, image: bytes, label: str, connect_patience_s: float
) -> Record:
    started = time.monotonic()
    retries = 0
    while True:
        try:
            reply = await client.post(
                "/v1/classify", files={"file": ("x.png", image, "image/png")}, data={"seed": str(index)}
            )
            break
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            # Refused, reset, or closed before any response by a coordinator going down (a connection the
            # kernel accepted into the backlog of a process that is exiting is reset): no incarnation
            # answered it, and classification is idempotent, so it is sent again (counted as a retry).
            if isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" not in str(exc):
                return Record(
                    index,
                    started,
                    time.monotonic() - started,
                    None,
                    f"RemoteProtocolError: {exc}",
                    connect_retries=retries,
                )
            retries += 1
            if time.monotonic() - started > connect_patience_s:
                return Record(
                    index, started, time.monotonic() - started, None, "connect: gave up", connect_retries=retries
                )
            await asyncio.sleep(0.1)
        except httpx.HTTPError as exc:
            return Record(
                index,
                started,
                time.monotonic() - started,
                None,
                f"{type(exc).__name__}: {exc}",
                connect_retries=retries,
            )
    latency = time.monotonic() - started
    try:
        body: dict[str, Any] = reply.json()
    except ValueError:
        return Record(index, started, latency, reply.status_code, "not JSON", connect_retries=retries)
    if reply.status_code != 200:
        return Record(index, started, latency, reply.status_code, str(body.get("error")), connect_retries=retries)
    hops: dict[str, int] = {}
    for hop in body["trace"]["hops"]:
        hops[hop["outcome"]] = hops.get(hop["outcome"], 0) + 1
    return Record(
        index,
        started,
        latency,
        200,
        correct=body["prediction"] == label,
        depth=body["depth"],
        hops=hops,
        connect_retries=retries,
        nodes=[hop["node"] for hop in body["trace"]["hops"] if hop.get("node")],
    )
