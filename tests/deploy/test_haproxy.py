"""deploy/haproxy/haproxy.cfg: the distribution's HAProxy in front of two real coordinator processes on
the same nodes. Clients that take one URL (curl, tritonclient, openai) keep getting answers while the
coordinator they were sent to is SIGKILLed: HAProxy's /readyz checks take it out, and a request it had
sent there goes to the other one. Skipped where haproxy is not installed (CI installs it)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from layerswarm.harness.procs import launch, stop_all

from ..coordinator.test_kserve import png
from ..swarm import coordinator_process, start_nodes

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
NO_HAPROXY = "haproxy not installed (apt-get install haproxy)"
pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason=NO_HAPROXY)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_config_is_valid() -> None:
    env = {**os.environ, "LB_BIND": "127.0.0.1:18080", "COORDINATOR_1": "127.0.0.1:1", "COORDINATOR_2": "127.0.0.1:2"}
    done = subprocess.run(["haproxy", "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def wait_for(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready within {timeout:.0f} s")


@pytest.mark.slow
def test_one_url_keeps_answering_while_a_coordinator_is_killed(family_dirs: list[Path]) -> None:
    nodes = start_nodes([(family_dirs[0], b) for b in range(3)])
    coords = [coordinator_process(family_dirs[0], nodes, "--health-interval", "0.2") for _ in range(2)]
    port = free_port()
    env = {
        "LB_BIND": f"127.0.0.1:{port}",
        "COORDINATOR_1": f"127.0.0.1:{coords[0].ready['port']}",
        "COORDINATOR_2": f"127.0.0.1:{coords[1].ready['port']}",
    }
    lb = launch("haproxy", ["haproxy", "-db", "-f", str(CONFIG)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{url}/readyz")
        statuses = []
        with httpx.Client(base_url=url, timeout=30) as http:
            for i in range(60):
                if i == 20:  # mid-traffic, the coordinator with the older start is gone at once
                    coords[0].popen.send_signal(signal.SIGKILL)
                response = http.post("/v1/classify", files={"file": ("a.png", png(1))}, data={"seed": "1"})
                statuses.append(response.status_code)
        assert statuses == [200] * 60, statuses
    finally:
        stop_all([lb, *coords, *nodes])
