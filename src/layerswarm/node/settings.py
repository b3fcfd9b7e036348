"""Node settings: built once from the command line, passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from layerswarm.wire.security import SecuritySettings


@dataclass(frozen=True)
class NodeSettings:
    model_dir: Path
    block: int
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (reported on stdout when ready)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 1  # torch threads; idle nodes' spinning OpenMP threads steal cores from busy ones
    max_in_flight: int = 64  # past this, RESOURCE_EXHAUSTED (the coordinator admits 64 requests at once)
    max_batch: int = 64
    micro_batch: bool = True  # run requests that queue up together as one batch
    max_message_bytes: int = 64 * 1024 * 1024
    metrics_port: int | None = None  # Prometheus /metrics; None: off
    advertise: bool = True  # mDNS (DNS-SD) announcement
    advertise_address: str | None = None  # address put in the mDNS record; default: the bound host
    mdns_interfaces: tuple[str, ...] = ()  # empty: all interfaces
    grace_s: float = 5.0  # drain time on SIGTERM
    security: SecuritySettings = field(default_factory=SecuritySettings)  # swarm token and/or mutual TLS
