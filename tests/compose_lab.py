"""Run docker-compose.yml's layerswarm services without Docker: each service a process on its own host
(a network namespace on a bridge, see netlab), with the compose file's command and environment.

It proves that the configuration users run discovers and serves, on a machine without a Docker
engine. Services with another image (Prometheus) are left out.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
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


def load_services(path: Path) -> list[ComposeService]:
    spec: dict[str, Any] = yaml.safe_load(path.read_text())
    services = []
    for name, service in spec["services"].items():
        if not str(service.get("image", "")).startswith("layerswarm"):
            continue
        env = {str(k): str(v) for k, v in (service.get("environment") or {}).items()}
        services.append(ComposeService(name, list(service["command"]), env, list(service.get("ports", []))))
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

    def stop(self) -> None:
        stop_all(list(self.procs.values()))
        self.lab.stop()


def start(path: Path, timeout: float = 120.0) -> ComposeSwarm:
    services = load_services(path)
    lab = NetLab().start()
    hosts: dict[str, Host] = {}
    procs: dict[str, Proc] = {}
    try:
        for service in services:
            hosts[service.name] = lab.add_host(service.name)
            argv = hosts[service.name].command([sys.executable, "-m", "layerswarm", *service.command])
            procs[service.name] = launch(service.name, argv, env=service.environment)
        for proc in procs.values():
            wait_for_ready_line(proc, timeout)
    except Exception:
        stop_all(list(procs.values()))
        lab.stop()
        raise
    return ComposeSwarm(lab, hosts, procs, services)
