"""Measured link costs between the coordinator and nodes and between nodes: pure bookkeeping.

Fed passively from real traffic: star hops give coordinator <-> node (the hop's time less the node's
compute, half each way), relay traces give node -> node (each node's forwarding time until the next
node's acknowledgement, less that node's compute). Read by the network-aware planner through one
method, `transfer_ms(src, dst, nbytes)` (coordinator/netorder.py: LinkCosts), so another estimator
(e.g. one fitting RTT and throughput separately) can stand in without touching the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COORDINATOR = "coordinator"
MAX_LINKS = 4096  # (src, dst) pairs kept; past this new pairs are not recorded (bounded memory)


@dataclass
class LinkSample:
    ms_per_mb: float = 0.0  # EWMA of transfer time per megabyte (one message of activation size)
    last_bytes: int = 0
    samples: int = 0
    ALPHA = 0.2

    def observe(self, nbytes: int, ms: float) -> None:
        value = max(ms, 0.0) / max(nbytes / 1e6, 1e-6)
        self.ms_per_mb = value if self.samples == 0 else self.ms_per_mb + self.ALPHA * (value - self.ms_per_mb)
        self.last_bytes = nbytes
        self.samples += 1

    def to_json(self) -> dict[str, Any]:
        mbps = 8e3 / self.ms_per_mb if self.ms_per_mb > 0 else None
        return {
            "ms_per_mb": round(self.ms_per_mb, 3),
            "mbps": None if mbps is None else round(mbps, 1),
            "samples": self.samples,
        }


class LinkMap:
    def __init__(self) -> None:
        self._links: dict[tuple[str, str], LinkSample] = {}

    def observe(self, src: str, dst: str, nbytes: int, ms: float) -> None:
        if nbytes <= 0:
            return
        key = (src, dst)
        if key not in self._links and len(self._links) >= MAX_LINKS:
            return
        self._links.setdefault(key, LinkSample()).observe(nbytes, ms)

    def transfer_ms(self, src: str, dst: str, nbytes: int) -> float | None:
        """Expected milliseconds to move `nbytes` from src to dst; None when never measured."""
        sample = self._links.get((src, dst))
        return None if sample is None else sample.ms_per_mb * nbytes / 1e6

    def from_node(self, address: str) -> dict[str, dict[str, Any]]:
        """The links measured out of `address` (for /v1/nodes)."""
        return {dst: s.to_json() for (src, dst), s in sorted(self._links.items()) if src == address}

    def forget(self, address: str) -> None:
        for key in [k for k in self._links if address in k]:
            del self._links[key]
