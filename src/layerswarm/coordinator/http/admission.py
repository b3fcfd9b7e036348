"""Admission: the one count of inference requests in flight, and the limit past which a new one is
answered 429 from its headers alone, before any of its body is read.

The process holds one (coordinator/process.py) and every API admits through it, so the native API,
text and KServe v2 share one limit; /metrics (`layerswarm_http_in_flight`) and the swarm page read the
same count.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from prometheus_client import Gauge

from .errors import ApiError


class Admission:
    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self.in_flight = 0  # changed only by admit()
        gauge.set_function(lambda: self.in_flight)  # read at scrape time: the gauge is this count

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one of `limit` places for the whole request, or 429 at once."""
        if self.in_flight >= self.limit:
            raise ApiError(429, "busy", f"{self.in_flight} requests in flight (limit {self.limit}); retry")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
