"""Coordinator settings: the one place their defaults are stated; loaded once at start-up, passed down.

Sources (wire/settings.py): defaults < `[coordinator]` in a TOML file < LAYERSWARM_COORDINATOR_* < the
command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.settings import ProcessSettings, security_from_files

CHOICES = {
    "default_policy": ("auto", "sequential", "shuffle", "fastest"),
    "wire_dtype": ("fp32", "fp16", "bf16"),
    "transport": ("stream", "unary"),
    "exit_rule": ("calibrated", "none", "confidence", "entropy", "patience"),
}


class CoordinatorSettings(ProcessSettings):
    model_config = SettingsConfigDict(env_prefix="LAYERSWARM_COORDINATOR_")
    section: ClassVar[str] = "coordinator"

    model_dir: Path
    family_dirs: tuple[Path, ...] = ()  # sibling model dirs whose manifests vouch for nodes' weights
    peers: tuple[str, ...] = ()  # static HOST:PORT nodes (networks without multicast)
    peer_dns: tuple[str, ...] = ()  # NAME:PORT resolved periodically (Kubernetes headless services)
    mdns: bool = True
    mdns_interfaces: tuple[str, ...] = ()
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=0, le=65535)
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=0.5, gt=0)
    eject_after: int = Field(default=2, ge=1)  # failed health checks in a row that eject a node
    quarantine_s: float = Field(default=30.0, ge=0)
    hedge_quantile: float | None = Field(default=0.95, gt=0, lt=1)  # None (0 from the CLI): no hedged requests
    hedge_min_ms: float = Field(default=10.0, ge=0)
    hop_timeout_s: float = Field(default=2.0, gt=0)
    request_timeout_s: float = Field(default=10.0, gt=0)
    min_blocks: int | None = Field(default=None, ge=1)  # None: the model's evaluated minimum depth, else 1
    strict: bool | None = None  # admit only listed model ids and hashes; None: strict when family_dirs given
    verify_rate: float | None = Field(default=0.05, ge=0, le=1)  # share of hops re-executed; None: no verification
    verify_probation: int = Field(default=2, ge=0)  # hops of each new node incarnation that are all re-executed
    # early exit by default: calibrated (the model dir's adaptive policy, if any), none, or a rule name
    exit_rule: str = "calibrated"
    exit_threshold: float | None = None  # with a rule name; None: that rule's calibrated threshold
    default_policy: str = "auto"  # auto: shuffle for shuffle-robust families, else sequential
    # fp16 halves the bytes per hop; on the shipped family it loses no accuracy (bench: wire formats)
    wire_dtype: str = "fp16"
    transport: str = "stream"  # stream: reused ForwardStream calls; unary: one Forward call per hop
    max_batch: int = Field(default=64, ge=1)
    max_upload_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    max_concurrent_requests: int = Field(default=64, ge=1)  # past this: 429, answered before any body is read
    # The HTTP front door (what each limit stops: README, Trust > HTTP front door)
    max_image_pixels: int = Field(default=4096 * 1024, ge=1)  # from the image header, before decoding (resize too)
    header_timeout_s: float = Field(default=10.0, gt=0)  # request line and headers must arrive within this
    body_timeout_s: float = Field(default=30.0, gt=0)  # the whole body must arrive within this
    max_connections: int = Field(default=512, ge=1)  # open HTTP connections; past this new ones get 503
    max_body_reads: int = Field(default=16, ge=1)  # bodies read at once (each up to max_upload_bytes in memory)
    api_keys: tuple[str, ...] = ()  # when set, inference endpoints need one (Authorization: Bearer KEY)
    threads: int = Field(default=1, ge=1)
    token_file: Path | None = None  # these four load `security` (keep secrets out of command lines)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    security: SecuritySettings = Field(default_factory=SecuritySettings)  # swarm token and/or mutual TLS
    state_file: Path | None = None  # last known peers (hints for a restart); None: not remembered
    startup_wait_s: float = Field(default=5.0, ge=0)  # longest wait for the first discovery round
    mdns_settle_s: float = Field(default=1.5, ge=0)  # with mDNS the first round lasts at least this long

    _security = model_validator(mode="before")(security_from_files)

    @field_validator("model_dir", mode="before")
    @classmethod
    def _shipped_model(cls, value: Any) -> Any:
        from layerswarm.models.zoo import resolve  # zoo:FAMILY/MEMBER names a shipped model

        return resolve(value) if isinstance(value, str) else value

    @field_validator("family_dirs", mode="before")
    @classmethod
    def _shipped_family(cls, values: Any) -> Any:
        from layerswarm.models.zoo import resolve

        return tuple(resolve(v) if isinstance(v, str) else v for v in values)

    @field_validator("hedge_quantile", mode="before")
    @classmethod
    def _zero_is_off(cls, value: Any) -> Any:
        return None if value in (0, 0.0, "0") else value

    @field_validator(*CHOICES)
    @classmethod
    def _one_of(cls, value: str, info: ValidationInfo) -> str:
        choices = CHOICES[str(info.field_name)]
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value

    @field_validator("peers", "peer_dns")
    @classmethod
    def _host_port(cls, peers: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        shape = "HOST:PORT" if info.field_name == "peers" else "NAME:PORT"
        for peer in peers:
            host, _, port = peer.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{peer!r} is not {shape} (a port from 1 to 65535)")
        return peers
