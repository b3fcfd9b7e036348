"""Coordinator settings: the one place their defaults are stated; loaded once at start-up, passed down.

Sources (wire/settings.py): defaults < `[coordinator]` in a TOML file < LAYERSWARM_COORDINATOR_* < the
command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from layerswarm.wire.exposure import INSECURE_HELP, exposure_problem
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.settings import ProcessSettings, security_from_files

# What the api_keys setting leaves open (stated here, where its help lists them; http/front_door.py keys the
# rest): probes and metrics (orchestrators and scrapers hold no key), the API schema and the page's login.
# Every other path needs a key: the API, the swarm page and its assets (or the login's cookie), /redoc,
# /v2/models.
OPEN_PATHS = (
    "/healthz",
    "/readyz",
    "/v2/health/live",
    "/v2/health/ready",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/login",  # the swarm page's login form: its cookie then opens the page (http/login.py)
)
# ... and /docs's own scripts and styles: a browser loading them from the page sends no key.
OPEN_PREFIXES = ("/static-offline-docs/",)

SPECULATION_MAX_K = 16  # drafts per verify trip (a node's verify step is k + 1 tokens)

CHOICES = {
    "default_policy": ("auto", "sequential", "shuffle", "fastest", "network"),
    "verify_on": ("auto", "coordinator", "peers"),
    "wire_dtype": ("fp32", "fp16", "bf16", "int8", "auto"),
    "frozen_dtype": ("int8", "wire"),
    "transport": ("stream", "unary"),
    "exit_rule": ("calibrated", "none", "confidence", "entropy", "patience"),
    "topology": ("star", "relay", "auto"),
}


class CoordinatorSettings(ProcessSettings):
    model_config = SettingsConfigDict(env_prefix="LAYERSWARM_COORDINATOR_")
    section: ClassVar[str] = "coordinator"

    model_dir: Path = Field(description="model directory: stem, head and family (or zoo:FAMILY/MEMBER)")
    family_dirs: tuple[Path, ...] = Field(
        default=(),
        description="another member's model directory, whose manifest vouches for its nodes' weights (repeatable)",
    )
    # Static peers serve networks without multicast; DNS names, Kubernetes headless services.
    peers: tuple[str, ...] = Field(default=(), description="static node (repeatable)")
    peer_dns: tuple[str, ...] = Field(
        default=(),
        description="resolve NAME periodically, every address a node (a Kubernetes headless service; repeatable)",
    )
    # Other coordinators of the same swarm: each conviction here is sent to them as a tip (membership/tips.py).
    coordinator_peers: tuple[str, ...] = Field(
        default=(),
        description="another coordinator's HTTP URL, told of each node convicted here (repeatable; needs "
        "--token-file: tips are signed with it)",
    )
    mdns: bool = True
    mdns_interfaces: tuple[str, ...] = Field(
        default=(), description="IP of an interface for mDNS (repeatable; none: all)"
    )
    http_host: str = Field(default="127.0.0.1", description="HTTP bind address")
    http_port: int = Field(default=8080, ge=0, le=65535, description="HTTP port (0: any free port)")
    health_interval_s: float = Field(default=1.0, gt=0, description="seconds between health checks")
    health_timeout_s: float = Field(default=0.5, gt=0)
    eject_after: int = Field(default=2, ge=1)  # failed health checks in a row that eject a node
    quarantine_s: float = Field(default=30.0, ge=0)
    # A node caught lying stays out for good; a new incarnation of it (a new boot id: the node's own claim)
    # only after this cool-down, doubled for each further conviction of its address (capped at a day).
    conviction_cooldown_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds a node's address stays barred after it is caught lying, whatever boot id it then "
        "reports (doubled for each further conviction, at most a day)",
    )
    hedge_quantile: float | None = Field(  # None (0 from the CLI): no hedged requests
        default=0.95,
        gt=0,
        lt=1,
        description="hedge a hop slower than this quantile of its node's recent latencies: send it to another "
        "node too, first answer wins (0: off)",
    )
    hedge_min_ms: float = Field(default=10.0, ge=0, description="never hedge sooner than this")
    hop_timeout_s: float = Field(default=2.0, gt=0, description="seconds per hop before substituting")
    request_timeout_s: float = Field(default=10.0, gt=0, description="seconds per request, all hops")
    # How many blocks a request needs: coordinator/routing/depth.py states the rule and each default's source.
    min_blocks: int | None = Field(
        default=None,
        ge=1,
        description="readiness: block indices that must be reachable to answer at all, else 503 naming the missing "
        "ones (none: the model's evaluated minimum useful depth from `layerswarm eval`, else 1); early exit and "
        "deadlines may still stop a path below it",
    )
    anytime_min_blocks: int | None = Field(
        default=None,
        ge=1,
        description="the fewest blocks an answer cut by a request's deadline_ms may have (none: the model's "
        "calibrated floor in adaptive.json, else the readiness minimum)",
    )
    strict: bool | None = None  # admit only listed model ids and hashes; None: strict when family_dirs given
    verify_rate: float | None = Field(  # None: no verification
        default=0.05,
        ge=0,
        le=1,
        description="share of hops the coordinator re-executes to catch lying nodes, after each new node's probation",
    )
    verify_probation: int = Field(default=2, ge=0, description="hops of each new node always re-executed")
    verify_on: str = Field(
        default="auto",
        description="where checked hops are re-executed: coordinator (its verified copy), peers (a replica "
        "with the same weights hash; a disagreement is decided by the coordinator's copy, or without one the "
        "weights are contested), auto (the coordinator when it holds the model, else peers)",
    )
    verify_decisive: int = Field(
        default=1,
        ge=0,
        description="hops of each answer that moved its prediction most, re-executed (on the coordinator's "
        "copy where it holds one) before the answer is returned: a lie that changes an answer is checked on it",
    )
    verify_contest_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds no replica of weights is routed to after replicas disagreed where this "
        "coordinator holds no copy to tell which one lies",
    )
    verify_deferred: bool = Field(
        default=True,
        description="re-execute checked hops while the path goes on (a failed check rewinds it; answers "
        "still wait for every check): the re-execution leaves the critical path",
    )
    exit_rule: str = Field(
        default="calibrated",
        description="default early exit: calibrated (the model dir's adaptive.json from `layerswarm eval "
        "--calibrate`: its rule, threshold and exit floor; none without one), none, or a rule",
    )
    exit_threshold: float | None = Field(
        default=None, description="threshold of --exit-rule (none: its calibrated one)"
    )
    default_policy: str = Field(
        default="auto",
        description="default path policy (auto: shuffle for shuffle-robust families; network: least expected time "
        "from measured compute and link costs)",
    )
    wire_dtype: str = Field(  # measured: bench, wire formats
        default="fp16",
        description="activations on the wire (fp16: half the bytes, no accuracy lost on the shipped family; "
        "fp32 for bit-exact outputs; int8: half again, for slow links; auto: int8 on each link where the bytes "
        "saved outweigh its codec time, from measured link costs, else fp16)",
    )
    # A frozen token is only read (keys and values) by later hops, and every hop must carry it: in the
    # activations' dtype it bounds per-token depth's byte saving at 2x in star (bench: text depth).
    frozen_dtype: str = Field(
        default="int8",
        description="text with per-token depth: how frozen tokens travel (only read as keys and values by later "
        "hops): int8 with per-token scales, or wire: in the activations' own dtype",
    )
    transport: str = Field(
        default="stream", description="stream: reused bidirectional streams; unary: one call per hop"
    )
    # auto is the default: it relays where relaying has measured faster (slow links: docs/relay.md) and stays
    # on star without a swarm token (nodes check chains with it) and for requests that need a per-hop exit or
    # an anytime deadline, which a chain gives up.
    topology: str = Field(
        default="auto",
        description="auto: per request, star or relay, whichever has been faster here (star without a token); "
        "star: every hop through the coordinator; relay: nodes forward to each other along a MACed chain "
        "(needs --token-file; docs/relay.md)",
    )
    max_batch: int = Field(default=64, ge=1)
    # Generation (decoder families): what a completion may ask, and what it gets when it asks nothing.
    max_new_tokens: int = Field(
        default=1024, ge=1, description="largest max_tokens a generation request may ask (also bounded by the context)"
    )
    default_max_tokens: int = Field(
        default=64, ge=1, description="tokens generated when a request gives no max_tokens (bounded by the context)"
    )
    speculation: str = Field(
        default="off",
        description="self-speculative decoding when a request does not say (docs/speculation.md): off, auto "
        f"(k adapts to the stream's acceptance and round trips), or k drafts per verify trip, 1 to {SPECULATION_MAX_K}",
    )
    early_exit: str = Field(
        default="off",
        description="per-token early exit when a request does not say (lossy; docs/speculation.md): off, on "
        "(the threshold `layerswarm eval` calibrated, in the model's policy), or a threshold over 0 and at most 1",
    )
    prefill_chunk_tokens: int = Field(
        # bench/prefill.py, 512 tokens, 12 nodes on 2 cores (docs/lm.md): 128 kept loopback under the monolith
        # (256 was faster there) and was the fastest of 256, 128 and 64 on the shaped 100 Mbit/s LAN
        default=128,
        ge=0,
        description="a prompt longer than this goes through the route in chunks of this many tokens, pipelined: "
        "the route's nodes compute different chunks at once (0: the whole prompt in one pass; on a swarm of "
        "separate devices smaller chunks keep more of them busy)",
    )
    draft_depth: int | None = Field(
        default=None,
        ge=1,
        description="blocks of the model the coordinator runs itself to draft (none: the depth `layerswarm eval` "
        "chose, in the model's policy, else a third of the depth)",
    )
    max_upload_bytes: int = Field(default=4 * 1024 * 1024, ge=1, description="largest image accepted")
    access_log: bool = Field(
        default=False, description="log one line per HTTP request: method, path, status, duration, request id"
    )
    # Answered from the headers, before any body is read, by every API (http/admission.py).
    max_concurrent_requests: int = Field(default=64, ge=1, description="past this many in flight: 429 busy")
    # The HTTP front door (what each limit stops: docs/http-api.md, "The front door")
    max_image_pixels: int = Field(
        default=4096 * 1024,
        ge=1,
        description="largest image (width x height, read from its header before decoding; with resize too)",
    )
    header_timeout_s: float = Field(default=10.0, gt=0, description="seconds for a client's request line and headers")
    body_timeout_s: float = Field(default=30.0, gt=0, description="seconds for a client to send a whole request body")
    write_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds for a client to read a response once its socket stopped taking bytes; then dropped",
    )
    max_header_bytes: int = Field(
        default=16384, ge=1024, description="largest request line and headers (counted across reads); past it: 431"
    )
    max_connections: int = Field(default=512, ge=1, description="open HTTP connections; past this a new one gets 503")
    # Each body read holds up to max_upload_bytes in memory.
    max_body_reads: int = Field(default=16, ge=1, description="request bodies read at once")
    api_keys: tuple[str, ...] = Field(
        default=(),
        description="file of API keys, one a line (several: rotation); every HTTP path then needs `Authorization: "
        "Bearer KEY` or `X-API-Key: KEY` (the API, the swarm page / (a browser logs in at /login once), /redoc, "
        "/v2/models...) except "
        f"{', '.join(OPEN_PATHS)}",
    )
    threads: int = Field(default=1, ge=1)
    token_file: Path | None = None  # these four load `security` (keep secrets out of command lines)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    security: SecuritySettings = Field(default_factory=SecuritySettings)  # swarm token and/or mutual TLS
    insecure: bool = Field(default=False, description=INSECURE_HELP)
    state_file: Path | None = Field(
        default=None,
        description="where to remember the last known peers, looked at first after a restart (hints only; none "
        "given: $XDG_STATE_HOME/layerswarm/coordinator-HTTP_PORT.json, none with --http-port 0)",
    )
    startup_wait_s: float = Field(default=5.0, ge=0)  # longest wait for the first discovery round
    mdns_settle_s: float = Field(default=1.5, ge=0)  # with mDNS the first round lasts at least this long

    _security = model_validator(mode="before")(security_from_files)

    @model_validator(mode="after")
    def _exposed_needs_a_secret(self) -> CoordinatorSettings:
        problem = exposure_problem(self.http_host, self.security, self.insecure, "--http-host")
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _relay_needs_token(self) -> CoordinatorSettings:
        if self.topology == "relay" and not self.security.token:
            raise ValueError("topology relay needs a swarm token (--token-file): nodes check chains with it")
        return self

    @model_validator(mode="after")
    def _tips_need_token(self) -> CoordinatorSettings:
        if self.coordinator_peers and not self.security.token:
            raise ValueError("--coordinator-peer needs a swarm token (--token-file): tips are signed with it")
        for url in self.coordinator_peers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--coordinator-peer {url!r}: an HTTP URL (http://HOST:PORT)")
        return self

    @field_validator("model_dir", mode="before")
    @classmethod
    def _shipped_model(cls, value: Any) -> Any:
        return _shipped(value)

    @field_validator("family_dirs", mode="before")
    @classmethod
    def _shipped_family(cls, values: Any) -> Any:
        return tuple(_shipped(v) for v in values)

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

    @field_validator("speculation")
    @classmethod
    def _speculation(cls, value: str) -> str:
        if value in ("off", "auto") or (value.isdigit() and 0 <= int(value) <= SPECULATION_MAX_K):
            return "off" if value == "0" else value
        raise ValueError(f"{value!r} is not off, auto, or a number of drafts 0 to {SPECULATION_MAX_K}")

    @field_validator("early_exit")
    @classmethod
    def _early_exit(cls, value: str) -> str:
        try:
            ok = value in ("off", "on") or 0.0 < float(value) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{value!r} is not off, on, or a threshold over 0 and at most 1")
        return value

    @model_validator(mode="after")
    def _one_decoding_mode(self) -> CoordinatorSettings:
        if self.speculation != "off" and self.early_exit != "off":
            raise ValueError("--speculation and --early-exit cannot both be on by default: pick one")
        return self

    @field_validator("peers", "peer_dns")
    @classmethod
    def _host_port(cls, peers: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        shape = "HOST:PORT" if info.field_name == "peers" else "NAME:PORT"
        for peer in peers:
            host, _, port = peer.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{peer!r} is not {shape} (a port from 1 to 65535)")
        return peers


def _shipped(value: Any) -> Any:
    """A model directory named `zoo:FAMILY/MEMBER` as the shipped model's path (other values as they are)."""
    if not isinstance(value, str):
        return value
    # Lazy: models.zoo loads torch (seconds), and these settings are read to build `--help`.
    from layerswarm.models.zoo import resolve  # noqa: PLC0415

    return resolve(value)
