"""The compose swarm under a real Docker engine, offline: build the CPU image (the coordinators'), the
lean node image (the nodes', no torch) and the load balancer's (HAProxy from Debian's .deb files) from
the debootstrap base, the wheelhouses and .debs-haproxy, `compose up` the docker-compose.yml users run,
wait for every HEALTHCHECK and for both coordinators to discover every node over mDNS on the compose
network, classify through the balancer's published port, crash a node container, classify again, and
watch the restart policy bring it back and the coordinators re-admit it; then crash a coordinator and
classify through the balancer while it is down.

Then the same swarm as a Docker Swarm stack (deploy/stack.yml) on a one-node swarm of the same engine:
two coordinator replicas behind the balancer, a rolling update of the coordinators while a client
classifies (no request may fail), and a node container crashed, replaced by the orchestrator and
re-admitted. Figures (image sizes, build times, up-to-ready, per-container memory, failover and update
timings) go to runs/docker/compose.json (LAYERSWARM_DOCKER_REPORT to change).

Minutes long, so it runs when asked: LAYERSWARM_DOCKER=1 scripts/test tests/deploy/test_docker.py (CI does).
It skips, with the reason, where no engine can start.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import signal
import subprocess
import threading
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
LB_IMAGE = "layerswarm-lb:haproxy"  # the balancer's (deploy/Dockerfile.haproxy)
PROJECT = "lsdockertest"
STACK = "lsstack"
BALANCER = "http://127.0.0.1:8080"  # the published port, compose's and the stack's
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
        de.haproxy_debs()
        engine = de.start()
    except de.EngineUnavailable as exc:
        pytest.skip(f"no Docker engine or image inputs: {exc}")
    try:
        de.import_base_image(engine)
        yield engine
    finally:
        de.stop(engine)


@pytest.fixture(scope="module")
def images(engine: de.Engine) -> dict[str, Any]:
    """The three images, built once for both tests; their figures."""
    return build_image(engine)


def report(section: str, figures: dict[str, Any]) -> None:
    """Write `figures` under `section` of the report, keeping the other tests' sections."""
    old = json.loads(REPORT.read_text()) if REPORT.is_file() else {}
    kept = {name: old[name] for name in ("compose", "stack") if name in old and name != section}
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps({**kept, section: figures}, indent=2) + "\n")


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
    started = time.monotonic()
    engine.docker(
        "build",
        "--file=deploy/Dockerfile.haproxy",
        f"--build-arg=BASE_IMAGE={de.BASE_IMAGE}",
        f"--build-arg=DEBS={de.haproxy_debs().name}",
        f"--tag={LB_IMAGE}",
        str(ROOT),
        timeout=600,
    )
    lb_seconds = time.monotonic() - started
    haproxy = engine.docker("run", "--rm", "--entrypoint=haproxy", LB_IMAGE, "-v").splitlines()[0]
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
        "balancer_image_mib": round(engine.inspect(LB_IMAGE)[0]["Size"] / 2**20, 1),
        "balancer_build_seconds": round(lb_seconds, 1),
        "haproxy": haproxy,
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


def coordinator_services() -> list[str]:
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return [name for name, s in spec["services"].items() if s.get("command", ["-"])[0] == "coordinator"]


def health(container: dict[str, Any]) -> str:
    return str(container["State"].get("Health", {}).get("Status"))


def memory_of(containers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each running container's memory (the exited swarm-token has no process)."""
    return {name: process_memory(c["State"]["Pid"]) for name, c in sorted(containers.items()) if c["State"]["Running"]}


def crash_a_coordinator(compose: Compose, client: httpx.Client, image: bytes, dead: str) -> dict[str, Any]:
    """SIGKILL one coordinator: the balancer sends every request to the other one (no client retry)."""
    os.kill(compose.containers()[dead]["State"]["Pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    codes = [classify(client, image, seed).status_code for seed in range(20)]
    assert codes == [200] * 20, codes
    wait_for(
        "the crashed coordinator back and healthy", lambda: health(compose.containers()[dead]) == "healthy", 300, 2
    )
    assert compose.containers()[dead]["RestartCount"] >= 1
    return {
        "coordinator_killed_requests_through_balancer": {"sent": len(codes), "ok": codes.count(200)},
        "coordinator_crash_to_healthy_seconds": round(time.monotonic() - killed_at, 1),
    }


def test_compose_swarm_in_docker(engine: de.Engine, images: dict[str, Any]) -> None:
    figures: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, no GPU",
        "engine": engine.docker("version", "--format", "{{.Server.Version}}").strip(),
        **images,
    }
    compose = Compose(engine)
    figures["compose"] = " ".join(compose.cli[:2] if compose.cli[1] == "compose" else compose.cli[:1])
    nodes = node_services()
    coordinators = coordinator_services()
    assert len(coordinators) == 2
    client = httpx.Client(base_url=BALANCER, timeout=30)  # the balancer's published port
    started = time.monotonic()
    compose.run("up", "--detach", "--no-build")
    direct: dict[str, httpx.Client] = {}
    try:
        # Ready: every node and coordinator container healthy by its HEALTHCHECK, and every node
        # discovered over mDNS by each coordinator (asked directly, on its compose network address).
        wait_for(
            "every node and coordinator container healthy",
            lambda: all(health(compose.containers()[n]) == "healthy" for n in (*nodes, *coordinators)),
            timeout=600,
            every=2,
        )
        containers = compose.containers()
        network = f"{PROJECT}_swarm"
        for name in coordinators:
            address = containers[name]["NetworkSettings"]["Networks"][network]["IPAddress"]
            direct[name] = httpx.Client(base_url=f"http://{address}:8080", timeout=30)
        found = {
            name: wait_for(f"{name} to discover every node", lambda c=c: all_found(c, len(nodes)), timeout=300)
            for name, c in direct.items()
        }
        figures["compose_up_to_ready_seconds"] = round(time.monotonic() - started, 1)
        addresses = {c["NetworkSettings"]["Networks"][network]["IPAddress"] for c in containers.values()}
        for name in coordinators:  # found on the compose network
            assert {n["address"].rsplit(":", 1)[0] for n in found[name]} <= addresses
        figures["memory_mib"] = memory_of(containers)

        data = load_dataset("shapes:10:20", seed=5)
        image, label = png_bytes(data.test_x[0].numpy()), data.class_names[int(data.test_y[0])]
        for name, c in direct.items():  # each coordinator answers on its own
            reply = classify(c, image)
            assert reply.status_code == 200 and reply.json()["prediction"] == label, (name, reply.text)
        reply = classify(client, image)  # and through the balancer
        assert reply.status_code == 200, reply.text
        assert reply.json()["depth"] == 8 and reply.json()["prediction"] == label

        # A crash (not `docker kill`, which the restart policy treats as a manual stop): SIGKILL the
        # container's process from the host, as the kernel's OOM killer would.
        victim = "node-b3-m0"
        before = next(n for n in found[coordinators[0]] if n["block"] == 3)
        os.kill(containers[victim]["State"]["Pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        for seed in range(3):
            reply = classify(client, image, seed)
            assert reply.status_code == 200, reply.text

        def readmitted(c: httpx.Client) -> dict[str, Any] | None:
            return next((n for n in healthy_nodes(c) if n["block"] == 3 and n["boot_id"] != before["boot_id"]), None)

        for name, c in direct.items():
            back = wait_for(f"the restart policy and {name} to re-admit the node", lambda c=c: readmitted(c), 300)
            assert back["model_id"] == before["model_id"]
        state = compose.containers()[victim]
        assert state["RestartCount"] >= 1 and state["State"]["Running"]
        wait_for(
            "the restarted container healthy",
            lambda: health(compose.containers()[victim]) == "healthy",
            timeout=120,
            every=2,
        )
        figures["crash_to_healthy_and_readmitted_seconds"] = round(time.monotonic() - killed_at, 1)
        reply = classify(client, image)
        assert reply.status_code == 200 and reply.json()["depth"] == 8

        figures.update(crash_a_coordinator(compose, client, image, coordinators[0]))
    finally:
        client.close()
        for c in direct.values():
            c.close()
        compose.run("down", "--timeout", "5")
    report("compose", figures)


class Stack:
    """deploy/stack.yml deployed with `docker stack deploy` on a one-node swarm of `engine`."""

    def __init__(self, engine: de.Engine) -> None:
        self.engine = engine

    def containers(self, service: str) -> list[dict[str, Any]]:
        """`docker inspect` of the service's running containers."""
        label = f"label=com.docker.swarm.service.name={STACK}_{service}"
        ids = self.engine.docker("ps", "--quiet", "--filter", label, "--filter", "status=running").split()
        return self.engine.inspect(*ids) if ids else []

    def healthy(self, service: str, count: int = 1) -> list[dict[str, Any]] | None:
        running = [c for c in self.containers(service) if health(c) == "healthy"]
        return running if len(running) == count else None

    def get(self, coordinator: dict[str, Any], path: str) -> str:
        """GET `path` from a coordinator inside its own container (overlay addresses are not reachable
        from the engine's host)."""
        script = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080{path}').read().decode())"
        return self.engine.docker("exec", coordinator["Id"], "python3", "-c", script, check=False)

    def classified(self, coordinator: dict[str, Any]) -> float:
        """How many classifications this replica answered 200 (its /metrics)."""
        lines = self.get(coordinator, "/metrics").splitlines()
        wanted = [line for line in lines if line.startswith("layerswarm_requests_total{") and "classify" in line]
        return sum(float(line.rsplit(" ", 1)[1]) for line in wanted if 'status="200"' in line)

    def nodes_seen_by(self, coordinator: dict[str, Any]) -> list[dict[str, Any]]:
        """A coordinator's healthy nodes, asked inside its own container (overlay addresses are not
        reachable from the engine's host)."""
        script = (
            "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080/v1/nodes').read().decode())"
        )
        out = self.engine.docker("exec", coordinator["Id"], "python3", "-c", script, check=False)
        try:
            return [n for n in json.loads(out)["nodes"] if n["state"] == "healthy"]
        except (json.JSONDecodeError, KeyError):
            return []


class Classifier:
    """A client classifying through the balancer, one request after another, until stopped: every
    answer that is not a 200 (or no answer) is a failed request."""

    def __init__(self, image: bytes) -> None:
        self.image, self.codes, self.errors = image, [], []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=BALANCER, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    self.codes.append(classify(client, self.image, len(self.codes)).status_code)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def __enter__(self) -> Classifier:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def failed(self) -> int:
        return sum(c != 200 for c in self.codes) + len(self.errors)


def stack_ready(stack: Stack, nodes: list[str]) -> list[dict[str, Any]] | None:
    """Both coordinator replicas healthy and each seeing every node."""
    coordinators = stack.healthy("coordinator", 2)
    if not coordinators or not all(stack.healthy(n) for n in nodes):
        return None
    return coordinators if all(len(stack.nodes_seen_by(c)) == len(nodes) for c in coordinators) else None


def test_stack_on_one_node_swarm(engine: de.Engine, images: dict[str, Any]) -> None:
    figures: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    engine.docker("swarm", "init", "--advertise-addr", "127.0.0.1")
    made = subprocess.run(
        [de.docker_cli(), "secret", "create", "layerswarm-token", "-"],
        input=secrets.token_hex(32),
        capture_output=True,
        text=True,
        env=engine.env,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    stack, nodes = Stack(engine), node_services()
    started = time.monotonic()
    engine.docker(
        "stack", "deploy", "--resolve-image", "never", "--compose-file", str(ROOT / "deploy" / "stack.yml"), STACK
    )
    try:
        coordinators = wait_for(
            "2 coordinators healthy, each seeing every node", lambda: stack_ready(stack, nodes), 600, 2
        )
        figures["stack_deploy_to_ready_seconds"] = round(time.monotonic() - started, 1)
        data = load_dataset("shapes:10:20", seed=5)
        image, label = png_bytes(data.test_x[0].numpy()), data.class_names[int(data.test_y[0])]
        with httpx.Client(base_url=BALANCER, timeout=30) as client:
            reply = wait_for(
                "the balancer to answer", lambda: (r := classify(client, image)).status_code == 200 and r, 60
            )
            assert reply.json()["depth"] == 8 and reply.json()["prediction"] == label

        # A rolling update of the coordinators (start-first, one at a time) while a client classifies.
        with Classifier(image) as client:
            time.sleep(3)
            started = time.monotonic()
            engine.docker("service", "update", "--force", "--detach=false", f"{STACK}_coordinator", timeout=600)
            figures["rolling_update_seconds"] = round(time.monotonic() - started, 1)
            time.sleep(3)
        figures["rolling_update_requests"] = {"sent": len(client.codes) + len(client.errors), "failed": client.failed()}
        assert client.failed() == 0, (client.codes, client.errors[:5])
        assert len(client.codes) >= 10
        after = wait_for("2 coordinators healthy after the update", lambda: stack.healthy("coordinator", 2), 120, 2)
        assert not {c["Id"] for c in after} & {c["Id"] for c in coordinators}  # both replaced
        with httpx.Client(base_url=BALANCER, timeout=30) as balanced:
            assert all(classify(balanced, image, seed).status_code == 200 for seed in range(20))
        served = [stack.classified(c) for c in after]
        figures["classified_by_each_new_replica"] = served
        assert all(n > 0 for n in served), served  # the balancer's two slots hold two different replicas

        # A node container crashes: the orchestrator starts a new task, both coordinators re-admit it.
        victim = stack.containers("node-b3-m0")[0]
        before = {n["boot_id"] for n in stack.nodes_seen_by(after[0]) if n["block"] == 3}
        with Classifier(image) as client:
            os.kill(victim["State"]["Pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            replaced = wait_for(
                "a new node-b3-m0 task healthy",
                lambda: [c for c in stack.healthy("node-b3-m0") or [] if c["Id"] != victim["Id"]],
                300,
                2,
            )
            for coordinator in after:
                wait_for(
                    "the coordinator to re-admit the new node",
                    lambda c=coordinator: any(
                        n["block"] == 3 and n["boot_id"] not in before for n in stack.nodes_seen_by(c)
                    ),
                    300,
                    2,
                )
            figures["node_crash_to_replaced_and_readmitted_seconds"] = round(time.monotonic() - killed_at, 1)
        figures["node_crash_requests"] = {"sent": len(client.codes) + len(client.errors), "failed": client.failed()}
        assert client.failed() == 0, (client.codes, client.errors[:5])
        assert replaced[0]["Config"]["Labels"]["com.docker.swarm.service.name"] == f"{STACK}_node-b3-m0"
    finally:
        engine.docker("stack", "rm", STACK, check=False)
        engine.docker("swarm", "leave", "--force", check=False)
    report("stack", figures)
