"""Coordinator settings: built once from the command line, passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from layerswarm.wire.security import SecuritySettings


@dataclass(frozen=True)
class CoordinatorSettings:
    model_dir: Path
    family_dirs: tuple[Path, ...] = ()  # sibling model dirs whose manifests vouch for nodes' weights
    peers: tuple[str, ...] = ()  # static HOST:PORT nodes (networks without multicast)
    peer_dns: tuple[str, ...] = ()  # NAME:PORT resolved periodically (Kubernetes headless services)
    mdns: bool = True
    mdns_interfaces: tuple[str, ...] = ()
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    health_interval_s: float = 1.0
    health_timeout_s: float = 0.5
    eject_after: int = 2
    quarantine_s: float = 30.0
    hedge_quantile: float | None = 0.95  # None: no hedged requests
    hedge_min_ms: float = 10.0
    hop_timeout_s: float = 2.0
    request_timeout_s: float = 10.0
    min_blocks: int = 1
    # early exit by default: calibrated (the model dir's adaptive policy, if any), none, or a rule name
    exit_rule: str = "calibrated"
    exit_threshold: float | None = None  # with a rule name; None: that rule's calibrated threshold
    default_policy: str = "auto"  # auto: shuffle for shuffle-robust families, else sequential
    # fp16 halves the bytes per hop; on the shipped family it loses no accuracy (bench: wire formats)
    wire_dtype: str = "fp16"
    transport: str = "stream"  # stream: reused ForwardStream calls; unary: one Forward call per hop
    max_batch: int = 64
    max_upload_bytes: int = 4 * 1024 * 1024
    max_concurrent_requests: int = 64
    threads: int = 1
    security: SecuritySettings = field(default_factory=SecuritySettings)  # swarm token and/or mutual TLS
    state_file: Path | None = None  # last known peers (hints for a restart); None: not remembered
    startup_wait_s: float = 5.0  # longest wait for the first discovery round before answering anyway
    mdns_settle_s: float = 1.5  # the first round lasts at least this long with mDNS (answers to our query)
