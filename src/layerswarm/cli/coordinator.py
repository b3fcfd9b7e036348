"""`layerswarm coordinator`: discover the family's nodes, route requests, serve HTTP."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerswarm.coordinator.settings import CHOICES, CoordinatorSettings

from .base import SettingsFlags, Subparsers, add_command, ensure_port_free, load_settings
from .security import add_security_flags


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "coordinator",
        run,
        help="discover nodes, route requests, serve HTTP",
        description="Own stem and head, discover the family's nodes (mDNS and static peers), and serve "
        "POST /v1/classify.",
    )
    f = SettingsFlags(p, CoordinatorSettings)
    f.add("--model-dir", "model_dir", "model directory: stem, head and family (or zoo:FAMILY/MEMBER)")
    f.add(
        "--family-dir",
        "family_dirs",
        "another member's model directory, whose manifest vouches for its nodes' weights (repeatable)",
        action="append",
    )
    f.add("--peer", "peers", "static node (repeatable)", action="append", metavar="HOST:PORT")
    f.add(
        "--peer-dns",
        "peer_dns",
        "resolve NAME periodically, every address a node (a Kubernetes headless service; repeatable)",
        action="append",
        metavar="NAME:PORT",
    )
    f.add("--no-mdns", "mdns", "static peers only (no multicast)", action="store_false")
    f.add("--mdns-interface", "mdns_interfaces", "IP of an interface for mDNS (repeatable; none: all)", action="append")
    f.add("--http-host", "http_host", "HTTP bind address")
    f.add("--http-port", "http_port", "HTTP port (0: any free port)", type=int)
    f.add(
        "--policy",
        "default_policy",
        "default path policy (auto: shuffle for shuffle-robust families)",
        choices=CHOICES["default_policy"],
    )
    f.add(
        "--min-blocks",
        "min_blocks",
        "fail (503) below this depth (none: the model's evaluated minimum useful depth, else 1)",
        type=int,
    )
    f.add(
        "--no-strict",
        "strict",
        "with --family-dir, also admit model ids no manifest lists (none given: strict when --family-dir is)",
        action="store_false",
    )
    f.add(
        "--verify-rate",
        "verify_rate",
        "share of hops the coordinator re-executes to catch lying nodes, after each new node's probation",
        type=float,
    )
    f.add(
        "--exit-rule",
        "exit_rule",
        "default early exit: calibrated (the model dir's adaptive.json from `layerswarm eval --calibrate`, none "
        "without one), none, or a rule",
        choices=CHOICES["exit_rule"],
    )
    f.add("--exit-threshold", "exit_threshold", "threshold of --exit-rule (none: its calibrated one)", type=float)
    f.add("--verify-probation", "verify_probation", "hops of each new node always re-executed", type=int)
    p.add_argument("--no-verify", action="store_true", help="never re-execute or range-check replies")
    f.add("--hop-timeout", "hop_timeout_s", "seconds per hop before substituting", type=float)
    f.add("--request-timeout", "request_timeout_s", "seconds per request, all hops", type=float)
    f.add("--health-interval", "health_interval_s", "seconds between health checks", type=float)
    f.add(
        "--hedge-quantile",
        "hedge_quantile",
        "hedge a hop slower than this quantile of its node's recent latencies: send it to another node too, "
        "first answer wins (0: off)",
        type=float,
    )
    f.add("--hedge-min-ms", "hedge_min_ms", "never hedge sooner than this", type=float)
    f.add(
        "--wire-dtype",
        "wire_dtype",
        "activations on the wire (fp16: half the bytes, no accuracy lost on the shipped family; fp32 for "
        "bit-exact outputs)",
        choices=CHOICES["wire_dtype"],
    )
    f.add(
        "--transport",
        "transport",
        "stream: reused bidirectional streams; unary: one call per hop",
        choices=CHOICES["transport"],
    )
    f.add("--max-upload-bytes", "max_upload_bytes", "largest image accepted", type=int)
    f.add("--max-concurrent-requests", "max_concurrent_requests", "past this many in flight: 429 busy", type=int)
    f.add(
        "--state-file",
        "state_file",
        "where to remember the last known peers, looked at first after a restart (hints only; none given: "
        "$XDG_STATE_HOME/layerswarm/coordinator-HTTP_PORT.json, none with --http-port 0)",
        type=Path,
    )
    p.add_argument("--no-state-file", action="store_true", help="do not remember peers across restarts")
    add_http_limit_flags(f)
    add_security_flags(f)


def add_http_limit_flags(f: SettingsFlags) -> None:
    """The HTTP front door: what each limit stops is in the README (Trust > HTTP front door)."""
    f.add(
        "--max-image-pixels",
        "max_image_pixels",
        "largest image (width x height, read from its header before decoding; with resize too)",
        type=int,
    )
    f.add("--max-body-reads", "max_body_reads", "request bodies read at once", type=int)
    f.add("--max-connections", "max_connections", "open HTTP connections; past this a new one gets 503", type=int)
    f.add("--header-timeout", "header_timeout_s", "seconds for a client's request line and headers", type=float)
    f.add("--body-timeout", "body_timeout_s", "seconds for a client to send a whole request body", type=float)
    f.add(
        "--api-key-file",
        "api_keys",
        "file of API keys, one a line (several: rotation); /v1/* then needs `Authorization: Bearer KEY` or "
        "`X-API-Key: KEY` (/healthz, /readyz, /metrics stay open)",
        type=api_keys,
    )


def api_keys(value: str) -> tuple[str, ...]:
    """argparse type: the keys in an API key file."""
    from layerswarm.coordinator.auth import read_api_keys

    try:
        return read_api_keys(Path(value))
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    import torch

    from layerswarm.coordinator.peer_memory import default_state_file
    from layerswarm.coordinator.server import run as serve

    settings: CoordinatorSettings = load_settings(args)
    if args.no_verify:
        settings = settings.model_copy(update={"verify_rate": None})
    if args.no_state_file:
        settings = settings.model_copy(update={"state_file": None})
    elif settings.state_file is None:
        settings = settings.model_copy(update={"state_file": default_state_file(settings.http_port)})
    ensure_port_free(settings.http_host, settings.http_port, "--http-port")
    torch.set_num_threads(settings.threads)  # once per process, at start-up
    return serve(settings)
