"""A swarm on this host: node processes laid out over a family, and waiting until it serves.

`up`, the benchmarks and the tests start swarms the same way; what "the swarm is up" means is
stated once (swarm_is_up) and read from the coordinator's /v1/nodes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx


def node_layout(members: list[Path], depth: int, count: int) -> list[tuple[Path, int]]:
    """Node k serves block k % depth of member (k // depth) % len(members): every block from the first
    model, then every block again from the next, so several models of the family stand behind each index."""
    return [(members[(k // depth) % len(members)], k % depth) for k in range(count)]


def healthy_count(view: dict[str, Any]) -> int:
    return sum(n["state"] == "healthy" for n in view.get("nodes", []))


def swarm_is_up(view: dict[str, Any], healthy: int = 0) -> bool:
    """Every block index reachable, and at least `healthy` nodes admitted and passing health checks."""
    return bool(view.get("depth")) and view.get("reachable_depth") == view["depth"] and healthy_count(view) >= healthy


def wait_for_swarm(client: httpx.Client, healthy: int = 0, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll the coordinator's /v1/nodes until swarm_is_up; return the last view, or raise TimeoutError."""
    deadline = time.monotonic() + timeout_s
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        view = client.get("/v1/nodes").json()
        if swarm_is_up(view, healthy):
            return view
        time.sleep(0.2)
    raise TimeoutError(
        f"the swarm did not come up in {timeout_s:.0f} s: {healthy_count(view)} of {healthy} nodes healthy, "
        f"{view.get('reachable_depth')} of {view.get('depth')} blocks reachable"
    )
