"""One URL in front of several coordinators (deploy/haproxy/haproxy.cfg): what a classification pays for
going through HAProxy, against the same two coordinators called directly, interleaved in one run.

Both sides alternate between the two coordinators (HAProxy balances by least connections; the direct
side takes them in turn), so the only difference is the balancer's hop on loopback.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from layerswarm.harness.procs import launch, stop_all
from layerswarm.models.zoo import family_root, robust_members

from .fixtures import coordinator_process, nodes
from .shipped import layout

CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "haproxy" / "haproxy.cfg"


def _png(seed: int, size: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready in {timeout_s:.0f} s")


def run(quick: bool) -> dict[str, Any]:
    if shutil.which("haproxy") is None:
        return {"skipped": "haproxy not installed (apt-get install haproxy)"}
    if not CONFIG.is_file():
        return {"skipped": f"{CONFIG} not found (an installed package has no deploy/)"}
    reps = 100 if quick else 400
    member = robust_members(family_root())[0]
    with nodes(layout([member])) as procs:
        coords = [coordinator_process(member, procs) for _ in range(2)]
        port = _free_port()
        env = {
            "LB_BIND": f"127.0.0.1:{port}",
            **{f"COORDINATOR_{i + 1}": f"127.0.0.1:{c.ready['port']}" for i, c in enumerate(coords)},
        }
        balancer = launch("bench-haproxy", ["haproxy", "-db", "-f", str(CONFIG)], env={**os.environ, **env})
        try:
            lb_url = f"http://127.0.0.1:{port}"
            _wait_ready(lb_url)
            direct = [f"http://127.0.0.1:{c.ready['port']}" for c in coords]
            samples = _interleaved(direct, lb_url, reps)
        finally:
            stop_all([balancer, *coords])
    direct_ms = round(statistics.median(samples["direct"]) * 1e3, 3)
    lb_ms = round(statistics.median(samples["balancer"]) * 1e3, 3)
    return {
        "requests_each": reps,
        "model": member.name,
        "direct_ms": direct_ms,
        "through_balancer_ms": lb_ms,
        "overhead_ms": round(lb_ms - direct_ms, 3),
        "ratio": round(lb_ms / direct_ms, 3),
    }


def _interleaved(direct: list[str], balancer: str, reps: int) -> dict[str, list[float]]:
    """Each round one request direct (the coordinators in turn) and one through the balancer, in an
    order that alternates; ten warm-up rounds first."""
    samples: dict[str, list[float]] = {"direct": [], "balancer": []}
    image = _png(0, 32)
    with httpx.Client(timeout=30) as http:
        for rep in range(reps + 10):
            targets = [("direct", direct[rep % len(direct)]), ("balancer", balancer)]
            for name, url in targets if rep % 2 else targets[::-1]:
                started = time.perf_counter()
                response = http.post(f"{url}/v1/classify", files={"file": ("a.png", image)}, data={"seed": str(rep)})
                elapsed = time.perf_counter() - started
                response.raise_for_status()
                if rep >= 10:
                    samples[name].append(elapsed)
    return samples


def render(r: dict[str, Any]) -> list[str]:
    if "skipped" in r:
        return [f"Load balancer: skipped ({r['skipped']})"]
    return [
        f"**One URL in front of two coordinators** (HAProxy, deploy/haproxy/haproxy.cfg; {r['model']}, one node per "
        f"block, batch 1, median of {r['requests_each']} requests each, interleaved)",
        "",
        "| path | ms | ratio |",
        "| --- | --- | --- |",
        f"| direct to a coordinator | {r['direct_ms']} | 1.000 |",
        f"| through HAProxy | {r['through_balancer_ms']} | {r['ratio']} |",
        "",
        f"The balancer's cost: {r['overhead_ms']} ms a request.",
    ]
