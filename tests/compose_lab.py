"""Run docker-compose.yml's layerswarm services without Docker: each service a process on its own host
(a network namespace on a bridge, see netlab), with the compose file's command and environment.

It proves that the configuration users run discovers and serves, on a machine without a Docker
engine. Services with another image (Prometheus) are left out. Named volumes are folders of a
temporary directory (a path inside a volume's mount point is rewritten to that folder), and one-shot
services (`restart: "no"`, such as the one that makes the swarm token) run to completion first, as
`depends_on: {condition: service_completed_successfully}` makes compose do.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from layerswarm.harness.netlab import Host, NetLab
from layerswarm.harness.procs import Proc, launch, stop_all, wait_for_ready_line


@dataclass
class ComposeService:
    name: str
    command: list[str]
    environment: dict[str, str]
    ports: list[str]
    volumes: list[str] = field(default_factory=list)  # NAME:MOUNT[:ro]
    one_shot: bool = False

    def argv(self, volumes: Path) -> list[str]:
        """The command with paths inside a mounted volume pointing at its folder under `volumes`."""
        mounts = [(v.split(":")[1], volumes / v.split(":")[0]) for v in self.volumes]
        out = []
        for arg in self.command:
            inside = next(((m, f) for m, f in mounts if arg == m or arg.startswith(m + "/")), None)
            out.append(arg if inside is None else str(inside[1]) + arg[len(inside[0]) :])
        return out


def load_services(path: Path) -> list[ComposeService]:
    spec: dict[str, Any] = yaml.safe_load(path.read_text())
    services = []
    for name, service in spec["services"].items():
        if not str(service.get("image", "")).startswith("layerswarm:"):  # not Prometheus, not the balancer
            continue
        env = {str(k): str(v) for k, v in (service.get("environment") or {}).items()}
        services.append(
            ComposeService(
                name,
                list(service["command"]),
                env,
                list(service.get("ports", [])),
                list(service.get("volumes", [])),
                service.get("restart") == "no",
            )
        )
    return services


@dataclass
class ComposeSwarm:
    lab: NetLab
    hosts: dict[str, Host]
    procs: dict[str, Proc]
    services: list[ComposeService]

    def url(self, service: str) -> str:
        """The published port of `service`, reached over the bridge (as localhost:PORT would be)."""
        published = next(s for s in self.services if s.name == service).ports[0].split(":")[-1]
        return f"http://{self.hosts[service].address}:{published}"

    volumes: tempfile.TemporaryDirectory[str] | None = None

    def stop(self) -> None:
        stop_all(list(self.procs.values()))
        self.lab.stop()
        if self.volumes is not None:
            self.volumes.cleanup()


def _resolve(arg: str, hosts: dict[str, Host]) -> str:
    """A URL naming another service, as compose's DNS would answer it: that service's host address."""
    for name, host in hosts.items():
        arg = arg.replace(f"//{name}:", f"//{host.address}:")
    return arg


def start(path: Path, timeout: float = 120.0) -> ComposeSwarm:
    services = load_services(path)
    volumes = tempfile.TemporaryDirectory(prefix="compose-volumes-")
    root = Path(volumes.name)
    for service in (s for s in services if s.one_shot):  # e.g. swarm-token: done before the others start
        subprocess.run([sys.executable, "-m", "layerswarm", *service.argv(root)], check=True, timeout=60)
    lab = NetLab().start()
    hosts: dict[str, Host] = {}
    procs: dict[str, Proc] = {}
    try:
        for service in (s for s in services if not s.one_shot):
            hosts[service.name] = lab.add_host(service.name)
        for service in (s for s in services if not s.one_shot):
            args = [_resolve(a, hosts) for a in service.argv(root)]  # http://coordinator-2:8080: its address
            argv = hosts[service.name].command([sys.executable, "-m", "layerswarm", *args])
            procs[service.name] = launch(service.name, argv, env=service.environment)
        for proc in procs.values():
            wait_for_ready_line(proc, timeout)
    except Exception:
        stop_all(list(procs.values()))
        lab.stop()
        volumes.cleanup()
        raise
    return ComposeSwarm(lab, hosts, procs, services, volumes)
