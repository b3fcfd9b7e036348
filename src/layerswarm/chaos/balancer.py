"""HAProxy in front of a chaos run's coordinators, for clients that take one URL: the distribution's
haproxy with the shipped deploy/haproxy/haproxy.cfg (health checks on /readyz, a request refused, cut
or answered 503 re-dispatched to another coordinator), one server line per coordinator. It listens on
the run's own loopback (the chaos process's private namespace). Not started where haproxy or the
config is missing: the report says why."""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from layerswarm.harness.procs import Proc, launch

CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "haproxy" / "haproxy.cfg"
SERVER_LINE = "    server coordinator-"


@dataclass
class Balancer:
    proc: Proc
    url: str
    config: Path

    def stop(self) -> None:
        self.proc.stop(5)
        self.config.unlink(missing_ok=True)


def unavailable() -> str | None:
    if shutil.which("haproxy") is None:
        return "haproxy is not installed (apt-get install haproxy)"
    if not CONFIG.is_file():
        return f"{CONFIG} is not there (an installed package, not a checkout)"
    return None


def start(coordinator_urls: list[str], timeout: float = 30.0) -> Balancer:
    """HAProxy on 127.0.0.1 (a free port) in front of `coordinator_urls`; returns once its /readyz is 200."""
    kept = [line for line in CONFIG.read_text().splitlines() if not line.startswith(SERVER_LINE)]
    servers = [f"{SERVER_LINE}{i + 1} {httpx.URL(u).host}:{httpx.URL(u).port}" for i, u in enumerate(coordinator_urls)]
    handle, name = tempfile.mkstemp(prefix="layerswarm-chaos-haproxy-", suffix=".cfg")
    config = Path(name)
    with open(handle, "w") as out:
        out.write("\n".join([*kept, *servers]) + "\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    proc = launch("haproxy", ["haproxy", "-db", "-f", str(config)], env={"LB_BIND": f"127.0.0.1:{port}"})
    balancer = Balancer(proc, f"http://127.0.0.1:{port}", config)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.alive:
        try:
            if httpx.get(f"{balancer.url}/readyz", timeout=2).status_code == 200:
                return balancer
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    balancer.stop()
    raise RuntimeError(f"haproxy did not become ready: {''.join(proc.output[-10:])}")
