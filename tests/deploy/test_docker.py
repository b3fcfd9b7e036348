"""The compose swarm under a real Docker engine, offline: build the CPU image (the coordinator's) and the
lean node image (the nodes', no torch) from the debootstrap base and the wheelhouses, `compose up` the
docker-compose.yml users run, wait for every HEALTHCHECK and for the coordinator to discover every node
over mDNS on the compose network, classify through the published port, crash a node container, classify
again, and watch the restart policy bring it back and the coordinator re-admit it. Figures (image sizes,
build times, up-to-ready, per-container memory) go to runs/docker/compose.json (LAYERSWARM_DOCKER_REPORT
to change).

Minutes long, so it runs when asked: LAYERSWARM_DOCKER=1 scripts/test tests/deploy/test_docker.py (CI does).
It skips, with the reason, where no engine can start.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from layerswarm.bench.nodes import process_memory
from layerswarm.harness.samples import png_bytes
from layerswarm.training.data.datasets import load_dataset

from .. import docker_engine as de

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "layerswarm:cpu"  # the coordinator's image in docker-compose.yml: built here with the offline build args
NODE_IMAGE = "layerswarm:node"  # the nodes' (deploy/Dockerfile.node: the lean node, no torch)
PROJECT = "lsdockertest"
REPORT = Path(os.environ.get("LAYERSWARM_DOCKER_REPORT", ROOT / "runs" / "docker" / "compose.json"))
T = TypeVar("T")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(2400),
    pytest.mark.skipif(os.environ.get("LAYERSWARM_DOCKER") != "1", reason="minutes long: set LAYERSWARM_DOCKER=1"),
]


def wait_for(what: str, check: Callable[[], T | None], timeout: float, every: float = 1.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def engine() -> Iterator[de.Engine]:
    try:
        de.wheelhouse()  # checked first: the inputs cannot be made from inside the namespace
        de.node_wheelhouse()
        de.base_tarball()
        engine = de.start()
    except de.EngineUnavailable as exc:
        pytest.skip(f"no Docker engine or image inputs: {exc}")
    try:
        de.import_base_image(engine)
        yield engine
    finally:
        de.stop(engine)


def build_image(engine: de.Engine) -> dict[str, Any]:
    wheels = de.wheelhouse()
    started = time.monotonic()
    engine.docker(
        "build",
        "--file=deploy/Dockerfile",
        f"--build-arg=BASE_IMAGE={de.BASE_IMAGE}",
        f"--build-arg=WHEELHOUSE={de.WHEELHOUSE}",
        f"--tag={IMAGE}",
        str(ROOT),
        timeout=1800,
    )
    seconds = time.monotonic() - started
    started = time.monotonic()
    engine.docker(
        "build",
        "--file=deploy/Dockerfile.node",
        f"--build-arg=BASE_IMAGE={de.BASE_IMAGE}",
        f"--build-arg=WHEELHOUSE={de.node_wheelhouse().name}",
        f"--tag={NODE_IMAGE}",
        str(ROOT),
        timeout=900,
    )
    node_seconds = time.monotonic() - started
    image = engine.inspect(IMAGE)[0]
    pip_list = engine.docker("run", "--rm", "--entrypoint=python3", IMAGE, "-m", "pip", "list", "--format=freeze")
    debs = engine.docker("run", "--rm", "--entrypoint=dpkg-query", IMAGE, "--show", "--showformat=${Package}\\n")
    return {
        "prepare": _prepare_figures(),  # seconds deploy/offline/prepare.sh took (null: cached)
        "python_packages": pip_list.split(),
        "debian_packages": len(debs.split()),
        "build_seconds_warm_wheelhouse": round(seconds, 1),
        "image_mib": round(image["Size"] / 2**20, 1),
        "node_image_mib": round(engine.inspect(NODE_IMAGE)[0]["Size"] / 2**20, 1),
        "node_build_seconds_warm_wheelhouse": round(node_seconds, 1),
        "base_image_mib": round(engine.inspect(de.BASE_IMAGE)[0]["Size"] / 2**20, 1),
        "wheelhouse_mib": round(sum(f.stat().st_size for f in wheels.glob("*.whl")) / 2**20, 1),
    }


def _prepare_figures() -> dict[str, Any] | None:
    path = ROOT / "runs" / "docker" / "prepare.json"
    return json.loads(path.read_text()) if path.is_file() else None


class Compose:
    def __init__(self, engine: de.Engine) -> None:
        self.engine = engine
        self.cli = [*de.compose_cli(engine.env), "--project-name", PROJECT, "--file", str(ROOT / "docker-compose.yml")]

    def run(self, *args: str, timeout: float = 300) -> str:
        result = subprocess.run(
            [*self.cli, *args], capture_output=True, text=True, env=self.engine.env, timeout=timeout, check=False
        )
        assert result.returncode == 0, f"compose {' '.join(args)}: {result.stderr[-2000:]}"
        return result.stdout

    def containers(self) -> dict[str, dict[str, Any]]:
        """Service name -> `docker inspect` of its container."""
        ids = self.run("ps", "--quiet").split()
        infos = self.engine.inspect(*ids) if ids else []
        return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in infos}


def node_services() -> list[str]:
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return [name for name, s in spec["services"].items() if name.startswith("node-") and not s.get("profiles")]


def healthy_nodes(client: httpx.Client) -> list[dict[str, Any]]:
    try:
        view = client.get("/v1/nodes").json()
    except httpx.HTTPError:
        return []
    return [n for n in view["nodes"] if n["state"] == "healthy" and n["source"] == "mdns"]


def all_found(client: httpx.Client, count: int) -> list[dict[str, Any]] | None:
    found = healthy_nodes(client)
    return found if len(found) == count else None


def classify(client: httpx.Client, image: bytes, seed: int = 0) -> httpx.Response:
    return client.post(
        "/v1/classify", files={"file": ("x.png", image, "image/png")}, data={"seed": str(seed), "exit_rule": "none"}
    )  # full depth, no early exit


def test_compose_swarm_in_docker(engine: de.Engine) -> None:
    figures: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, no GPU",
        "engine": engine.docker("version", "--format", "{{.Server.Version}}").strip(),
        **build_image(engine),
    }
    compose = Compose(engine)
    figures["compose"] = " ".join(compose.cli[:2] if compose.cli[1] == "compose" else compose.cli[:1])
    nodes = node_services()
    client = httpx.Client(base_url="http://127.0.0.1:8080", timeout=30)  # the published port
    started = time.monotonic()
    compose.run("up", "--detach", "--no-build")
    try:
        # Ready: every node container healthy by its HEALTHCHECK, and every node discovered over mDNS.
        wait_for(
            "every node container healthy",
            lambda: all(compose.containers()[n]["State"].get("Health", {}).get("Status") == "healthy" for n in nodes),
            timeout=600,
            every=2,
        )
        found = wait_for("the coordinator to discover every node", lambda: all_found(client, len(nodes)), timeout=300)
        figures["compose_up_to_ready_seconds"] = round(time.monotonic() - started, 1)
        containers = compose.containers()
        addresses = {c["NetworkSettings"]["Networks"][f"{PROJECT}_swarm"]["IPAddress"] for c in containers.values()}
        assert {n["address"].rsplit(":", 1)[0] for n in found} <= addresses  # found on the compose network
        figures["memory_mib"] = {name: process_memory(c["State"]["Pid"]) for name, c in sorted(containers.items())}

        data = load_dataset("shapes:10:20", seed=5)
        image, label = png_bytes(data.test_x[0].numpy()), data.class_names[int(data.test_y[0])]
        reply = classify(client, image)
        assert reply.status_code == 200, reply.text
        assert reply.json()["depth"] == 8 and reply.json()["prediction"] == label

        # A crash (not `docker kill`, which the restart policy treats as a manual stop): SIGKILL the
        # container's process from the host, as the kernel's OOM killer would.
        victim = "node-b3-m0"
        before = next(n for n in found if n["block"] == 3)
        os.kill(containers[victim]["State"]["Pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        for seed in range(3):
            reply = classify(client, image, seed)
            assert reply.status_code == 200, reply.text

        def readmitted() -> dict[str, Any] | None:
            return next(
                (n for n in healthy_nodes(client) if n["block"] == 3 and n["boot_id"] != before["boot_id"]), None
            )

        back = wait_for("the restart policy and the coordinator to re-admit the node", readmitted, timeout=300)
        assert back["model_id"] == before["model_id"]
        state = compose.containers()[victim]
        assert state["RestartCount"] >= 1 and state["State"]["Running"]
        wait_for(
            "the restarted container healthy",
            lambda: compose.containers()[victim]["State"]["Health"]["Status"] == "healthy",
            timeout=120,
            every=2,
        )
        figures["crash_to_healthy_and_readmitted_seconds"] = round(time.monotonic() - killed_at, 1)
        reply = classify(client, image)
        assert reply.status_code == 200 and reply.json()["depth"] == 8
    finally:
        client.close()
        compose.run("down", "--timeout", "5")
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(figures, indent=2) + "\n")
