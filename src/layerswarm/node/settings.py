"""Node settings: the one place their defaults are stated; loaded once at start-up, passed down.

Sources (wire/settings.py): defaults < `[node]` in a TOML file < LAYERSWARM_NODE_* < the command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from layerswarm.wire.exposure import INSECURE_HELP, exposure_problem
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.settings import ProcessSettings, security_from_files

DEVICE_KINDS = ("auto", "cpu", "cuda", "mps")
# What numpy's BLAS reads its thread count from when it loads (the numpy engine's --threads).
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
ENGINES = ("auto", "torch", "numpy")  # what computes a node's block (node/engines/)


class NodeSettings(ProcessSettings):
    model_config = SettingsConfigDict(env_prefix="LAYERSWARM_NODE_")
    section: ClassVar[str] = "node"

    model_dir: Path = Field(description="model directory holding the block (or zoo:shapes/layershuffle-0)")
    block: int = Field(ge=0, description="index of the block to serve")
    host: str = Field(default="127.0.0.1", description="address to bind (0.0.0.0 on a LAN)")
    # The port is reported on stdout in the ready line (with 0, the one the system chose).
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port (0: any free port)")
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    # What computes the block (node/engines/): numpy needs no torch (a node for small boards).
    engine: str = Field(
        default="auto",
        description="auto | torch | numpy: what computes the block; auto is torch where it is installed, "
        "else numpy (CPU only, no torch imported)",
    )
    # One by default: idle nodes' spinning OpenMP threads steal cores from busy ones.
    threads: int = Field(default=1, ge=1, description="compute threads (torch's, or the numpy engine's BLAS)")
    # The coordinator admits 64 requests at once by default; past this a node answers RESOURCE_EXHAUSTED.
    max_in_flight: int = Field(default=64, ge=1, description="past this: RESOURCE_EXHAUSTED")
    max_batch: int = Field(default=64, ge=1, description="largest batch accepted")
    micro_batch: bool = True  # run requests that queue up together as one batch
    # Relay chains: forward to each next node over one long-lived stream (off: a Relay call per chain,
    # about half a millisecond more a hop on loopback).
    relay_streams: bool = True
    max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # What a peer can hold at once (node/guard.py): decided before any of its messages is read.
    max_calls: int = Field(default=1024, ge=1, description="calls (and streams) at once, from everyone")
    max_calls_per_peer: int = Field(
        default=256, ge=1, description="calls at once from one address with swarm credentials (and per connection)"
    )
    max_stranger_calls: int = Field(
        default=16, ge=1, description="calls at once without swarm credentials (health, Info), from everyone"
    )
    max_stranger_calls_per_peer: int = Field(
        default=4, ge=1, description="calls at once without swarm credentials from one address"
    )
    stranger_rate: float = Field(
        default=10.0, gt=0, description="calls a second without swarm credentials from one address (bursts of twice)"
    )
    # Generation (decoder blocks, docs/generation.md): the streams whose keys and values this node keeps.
    # A stream's tokens are bounded by the model's context (max_seq_len); these bound the node.
    max_streams: int = Field(
        default=64,
        ge=1,
        description="decoder blocks: streams held at once (then the least recently used idle one goes)",
    )
    max_cache_mib: float = Field(
        default=256.0, gt=0, description="decoder blocks: MiB of keys and values for all streams together"
    )
    idle_timeout_s: float = Field(
        default=60.0, gt=0, description="decoder blocks: free a stream no step has touched for this many seconds"
    )
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="serve Prometheus metrics on this port")
    advertise: bool = True  # mDNS (DNS-SD) announcement
    advertise_address: str | None = Field(
        default=None,
        description="IPv4 address, or interface name (wlan0), to put in the mDNS record; none: the bound host, "
        "or with --host 0.0.0.0 the source address of the default route (else of the mDNS group's route)",
    )
    mdns_interfaces: tuple[str, ...] = Field(
        default=(), description="IP of an interface for mDNS (repeatable; none: all)"
    )
    grace_s: float = Field(default=5.0, ge=0, description="seconds to drain on SIGTERM")
    token_file: Path | None = None  # these six load `security` (keep secrets out of command lines)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    tls_relay_cert: Path | None = None  # the node's client certificate towards the next node of a chain
    tls_relay_key: Path | None = None
    security: SecuritySettings = Field(default_factory=SecuritySettings)  # swarm token and/or mutual TLS
    insecure: bool = Field(default=False, description=INSECURE_HELP)

    _security = model_validator(mode="before")(security_from_files)

    @model_validator(mode="after")
    def _exposed_needs_a_secret(self) -> NodeSettings:
        problem = exposure_problem(self.host, self.security, self.insecure, "--host")
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def max_cache_bytes(self) -> int:
        return int(self.max_cache_mib * 1024 * 1024)

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        # Checked here, not by torch.device(), which raises a RuntimeError listing twenty device kinds.
        kind, _, index = value.partition(":")
        if kind not in DEVICE_KINDS or (index and (kind != "cuda" or not index.isdigit())):
            raise ValueError(f"{value!r} is not one of auto, cpu, cuda, cuda:N, mps")
        return value

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value not in ENGINES:
            raise ValueError(f"{value!r} is not one of {', '.join(ENGINES)}")
        return value

    @field_validator("model_dir", mode="before")
    @classmethod
    def _shipped_model(cls, value: Any) -> Any:
        # zoo:FAMILY/MEMBER names a shipped model. Imported here: `layerswarm --help` builds this class's
        # flags without reading the zoo.
        from layerswarm.models.zoo import resolve  # noqa: PLC0415

        return resolve(value) if isinstance(value, str) else value
