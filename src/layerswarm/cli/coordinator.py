"""`layerswarm coordinator`: discover the family's nodes, route requests, serve HTTP."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerswarm.coordinator import CHOICES, CoordinatorSettings
from layerswarm.wire.memory import few_arenas, keep_large_buffers

from .base import SettingsFlags, Subparsers, add_command, ensure_can_listen, load_settings
from .security import add_security_flags


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "coordinator",
        run,
        help="discover nodes, route requests, serve HTTP",
        description="Own stem and head, discover the family's nodes (mDNS and static peers), and serve "
        "POST /v1/classify (classifier families) or POST /v1/generate and the OpenAI-compatible "
        "/v1/completions and /v1/chat/completions (decoder families).",
    )
    f = SettingsFlags(p, CoordinatorSettings)
    f.group("model and family", "what this coordinator serves, and whose weights its nodes may hold")
    f.add("--model-dir", "model_dir")
    f.add("--family-dir", "family_dirs", action="append")
    f.add(
        "--no-strict",
        "strict",
        "with --family-dir, also admit model ids no manifest lists (none given: strict when --family-dir is)",
        action="store_false",
    )
    add_discovery_flags(f)
    f.group("routing", "how a request's path through the nodes is chosen and timed")
    f.add("--policy", "default_policy", choices=CHOICES["default_policy"])
    f.add("--topology", "topology", choices=CHOICES["topology"])
    f.add("--transport", "transport", choices=CHOICES["transport"])
    f.add("--hop-timeout", "hop_timeout_s", type=float)
    f.add("--request-timeout", "request_timeout_s", type=float)
    f.add("--hedge-quantile", "hedge_quantile", type=float)
    f.add("--hedge-min-ms", "hedge_min_ms", type=float)
    f.add("--wire-dtype", "wire_dtype", choices=CHOICES["wire_dtype"])
    f.add("--frozen-dtype", "frozen_dtype", choices=CHOICES["frozen_dtype"])
    f.group(
        "adaptive compute",
        "how many blocks a request needs and when it may stop early (the rule is printed at start; docs/adaptive.md)",
    )
    f.add("--min-blocks", "min_blocks", type=int)
    f.add("--anytime-min-blocks", "anytime_min_blocks", type=int)
    f.add("--exit-rule", "exit_rule", choices=CHOICES["exit_rule"])
    f.add("--exit-threshold", "exit_threshold", type=float)
    add_verification_flags(f)
    f.group("generation", "decoder families: /v1/generate and the OpenAI-compatible endpoints")
    f.add("--max-new-tokens", "max_new_tokens", type=int)
    f.add("--default-max-tokens", "default_max_tokens", type=int)
    f.add("--speculation", "speculation", metavar="off|auto|K")
    f.add("--early-exit", "early_exit", metavar="off|on|THRESHOLD")
    f.add("--draft-depth", "draft_depth", type=int)
    f.add("--prefill-chunk", "prefill_chunk_tokens", type=int)
    f.group("HTTP", "the HTTP server and its front door (docs/http-api.md)")
    f.add("--http-host", "http_host")
    f.add("--http-port", "http_port", type=int)
    f.add("--max-concurrent-requests", "max_concurrent_requests", type=int)
    f.add("--max-upload-bytes", "max_upload_bytes", type=int)
    f.add("--access-log", "access_log", action="store_true")
    add_http_limit_flags(f)
    f.group("security", "the swarm token and mutual TLS toward nodes (docs/trust.md); API keys are under HTTP")
    add_security_flags(f)
    f.add("--insecure", "insecure", action="store_true")


def add_discovery_flags(f: SettingsFlags) -> None:
    """How nodes are found and remembered."""
    group = f.group("discovery", "how nodes are found (mDNS, static peers, DNS) and kept track of")
    f.add("--peer", "peers", action="append", metavar="HOST:PORT")
    f.add("--peer-dns", "peer_dns", action="append", metavar="NAME:PORT")
    f.add("--coordinator-peer", "coordinator_peers", action="append", metavar="URL")
    f.add("--no-mdns", "mdns", "static peers only (no multicast)", action="store_false")
    f.add("--mdns-interface", "mdns_interfaces", action="append")
    f.add("--health-interval", "health_interval_s", type=float)
    f.add("--state-file", "state_file", type=Path)
    group.add_argument("--no-state-file", action="store_true", help="do not remember peers across restarts")


def add_verification_flags(f: SettingsFlags) -> None:
    """How lying nodes are caught (docs/trust-verification.md)."""
    group = f.group("verification", "re-executing hops to catch nodes that lie (docs/trust-verification.md)")
    f.add("--verify-rate", "verify_rate", type=float)
    f.add("--verify-probation", "verify_probation", type=int)
    f.add("--verify-on", "verify_on", choices=CHOICES["verify_on"])
    f.add("--verify-decisive", "verify_decisive", type=int)
    f.add("--verify-contest", "verify_contest_s", type=float)
    f.add(
        "--no-verify-deferred",
        "verify_deferred",
        "re-execute each checked hop before the next hop starts (the blocking checks of before)",
        action="store_false",
    )
    group.add_argument("--no-verify", action="store_true", help="never re-execute or range-check replies")
    f.add("--conviction-cooldown", "conviction_cooldown_s", type=float)


def add_http_limit_flags(f: SettingsFlags) -> None:
    """The HTTP front door: what each limit stops is in docs/http-api.md ("The front door")."""
    f.add("--max-image-pixels", "max_image_pixels", type=int)
    f.add("--max-body-reads", "max_body_reads", type=int)
    f.add("--max-connections", "max_connections", type=int)
    f.add("--header-timeout", "header_timeout_s", type=float)
    f.add("--body-timeout", "body_timeout_s", type=float)
    f.add("--write-timeout", "write_timeout_s", type=float)
    f.add("--max-header-bytes", "max_header_bytes", type=int)
    f.add("--api-key-file", "api_keys", type=api_keys)


def api_keys(value: str) -> tuple[str, ...]:
    """argparse type: the keys in an API key file."""
    from layerswarm.coordinator import read_api_keys

    try:
        return read_api_keys(Path(value))
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    import torch

    from layerswarm.coordinator import default_state_file
    from layerswarm.coordinator import run as serve

    settings: CoordinatorSettings = load_settings(args)
    if args.no_verify:
        settings = settings.model_copy(update={"verify_rate": None})
    if args.no_state_file:
        settings = settings.model_copy(update={"state_file": None})
    elif settings.state_file is None:
        settings = settings.model_copy(update={"state_file": default_state_file(settings.http_port)})
    ensure_can_listen(settings.http_host, settings.http_port, "--http-host", "--http-port")
    torch.set_num_threads(settings.threads)  # once per process, at start-up
    keep_large_buffers()  # activations reuse freed pages instead of faulting in new ones (wire/memory.py)
    few_arenas()  # threads share a few arenas, whose free pages the heap keeper gives back (coordinator/memory.py)
    return serve(settings)
