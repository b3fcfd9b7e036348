"""Measured link costs between the coordinator and nodes and between nodes: pure bookkeeping.

Fed passively from real traffic: star hops give coordinator <-> node (the hop's time less the node's
compute, half each way), relay traces give node -> node (each node's forwarding time until the next
node's acknowledgement, less that node's compute). The health checks (a few bytes every health
interval, busy or idle) are the small probes: their round trip is the link's fixed cost, so a
transfer costs `rtt / 2 + bytes x ms_per_mb` and the per-byte part is what is left of a large
message's time once half the RTT is taken off. Node -> node links are probed by the sending node
(node/peers.py), which reports the RTT in each relay trace entry. Read by the network-aware planner
through `transfer_ms(src, dst, nbytes)` (routing/netorder.py: LinkCosts) and by the wire choice
through `per_mb`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

from layerswarm.wire.stats import ewma

COORDINATOR = "coordinator"
MAX_LINKS = 4096  # (src, dst) pairs kept; past this new pairs are not recorded (bounded memory)
ALPHA = 0.2  # the EWMAs' weight of a new sample


class LinkView(TypedDict):
    ms_per_mb: float
    mbps: float | None
    rtt_ms: float | None
    samples: int


@dataclass
class LinkSample:
    ms_per_mb: float = 0.0  # EWMA of transfer time per megabyte, less half the RTT when one is known
    last_bytes: int = 0
    samples: int = 0
    rtt_ms: float | None = None  # EWMA of the health probe's round trip (coordinator links)

    def observe(self, nbytes: int, ms: float) -> None:
        fixed = (self.rtt_ms or 0.0) / 2
        value = max(ms - fixed, 0.0) / max(nbytes / 1e6, 1e-6)
        self.ms_per_mb = ewma(self.ms_per_mb if self.samples else None, value, ALPHA)
        self.last_bytes = nbytes
        self.samples += 1

    def observe_rtt(self, ms: float) -> None:
        ms = max(ms, 0.0)
        self.rtt_ms = ewma(self.rtt_ms, ms, ALPHA)

    def transfer_ms(self, nbytes: int) -> float:
        return (self.rtt_ms or 0.0) / 2 + self.ms_per_mb * nbytes / 1e6

    def to_json(self) -> LinkView:
        mbps = 8e3 / self.ms_per_mb if self.ms_per_mb > 0 else None
        return {
            "ms_per_mb": round(self.ms_per_mb, 3),
            "mbps": None if mbps is None or self.samples == 0 else round(mbps, 1),
            "rtt_ms": None if self.rtt_ms is None else round(self.rtt_ms, 3),
            "samples": self.samples,
        }


class LinkMap:
    def __init__(self) -> None:
        self._links: dict[tuple[str, str], LinkSample] = {}

    def observe(self, src: str, dst: str, nbytes: int, ms: float) -> None:
        # Times come from peers' reports too: one NaN or inf would stay in the average for good.
        if nbytes <= 0 or not math.isfinite(ms):
            return
        key = (src, dst)
        if key not in self._links and len(self._links) >= MAX_LINKS:
            return
        self._links.setdefault(key, LinkSample()).observe(nbytes, ms)

    def observe_rtt(self, src: str, dst: str, ms: float) -> None:
        """A small probe's round trip between src and dst (both directions share it)."""
        if not math.isfinite(ms):
            return
        for key in ((src, dst), (dst, src)):
            if key not in self._links and len(self._links) >= MAX_LINKS:
                continue
            self._links.setdefault(key, LinkSample()).observe_rtt(ms)

    def transfer_ms(self, src: str, dst: str, nbytes: int) -> float | None:
        """Expected milliseconds to move `nbytes` from src to dst; None when no activation crossed it yet."""
        sample = self._links.get((src, dst))
        return None if sample is None or sample.samples == 0 else sample.transfer_ms(nbytes)

    def per_mb(self, src: str, dst: str) -> float | None:
        """The per-byte part of a transfer (ms per megabyte); None when no activation crossed it yet."""
        sample = self._links.get((src, dst))
        return None if sample is None or sample.samples == 0 else sample.ms_per_mb

    def from_node(self, address: str) -> dict[str, LinkView]:
        """The links measured out of `address` (for /v1/nodes)."""
        return {dst: s.to_json() for (src, dst), s in sorted(self._links.items()) if src == address}

    def forget(self, address: str) -> None:
        for key in [k for k in self._links if address in k]:
            del self._links[key]
