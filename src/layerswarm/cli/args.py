"""Argument definitions for the node, coordinator, up and probe commands (built by cli.build_parser)."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerswarm.wire.security import SecuritySettings


def model_dir(value: str) -> Path:
    """argparse type: a model directory path, or zoo:FAMILY/MEMBER for shipped weights."""
    from layerswarm.models.zoo import resolve

    try:
        return resolve(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_security_args(p: argparse.ArgumentParser, token: bool = True) -> None:
    if token:
        p.add_argument(
            "--token-file",
            type=Path,
            help="file holding the shared swarm token; it is never sent: calls are signed with MACs derived "
            "from it and nodes prove they hold it too (docs/trust.md); keep it out of the command line",
        )
    p.add_argument(
        "--tls-cert",
        type=Path,
        help="this process's certificate (PEM) for mutual TLS (deploy/make-certs.sh makes a swarm's certificates)",
    )
    p.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    p.add_argument("--tls-ca", type=Path, help="the swarm's CA certificate (PEM): peers must be signed by it")


def security_from_args(args: argparse.Namespace) -> SecuritySettings:
    return SecuritySettings.from_files(getattr(args, "token_file", None), args.tls_cert, args.tls_key, args.tls_ca)


def add_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-dir",
        required=True,
        type=model_dir,
        help="model directory holding the block (or zoo:shapes/layershuffle-0 for shipped weights)",
    )
    p.add_argument("--block", required=True, type=int, help="index of the block to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 on a LAN; default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port; default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--max-in-flight", type=int, default=64, help="past this: RESOURCE_EXHAUSTED")
    p.add_argument("--max-batch", type=int, default=64, help="largest batch accepted")
    p.add_argument(
        "--no-micro-batch",
        action="store_true",
        help="compute each request alone (default: requests that queue up run as one batch)",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (default: off)")
    p.add_argument("--no-advertise", action="store_true", help="do not announce over mDNS (static peers only)")
    p.add_argument("--advertise-address", help="address to put in the mDNS record (default: the bound host)")
    p.add_argument("--mdns-interface", action="append", default=[], help="IP of an interface for mDNS (repeatable)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds to drain on SIGTERM (default: %(default)s)")
    add_security_args(p)
    p.add_argument("--fault-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # test-only
    p.add_argument("--fault-mode", choices=["none", "nan", "shape", "dtype"], default="none", help=argparse.SUPPRESS)


def add_coordinator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-dir",
        required=True,
        type=model_dir,
        help="model directory: stem, head and family (or zoo:FAMILY/MEMBER)",
    )
    p.add_argument(
        "--family-dir",
        action="append",
        type=model_dir,
        default=[],
        help="another member's model directory: its manifest vouches for its nodes' weights",
    )
    p.add_argument("--peer", action="append", default=[], metavar="HOST:PORT", help="static node (repeatable)")
    p.add_argument(
        "--peer-dns",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="resolve NAME periodically, every address a node (a Kubernetes headless service)",
    )
    p.add_argument("--no-mdns", action="store_true", help="static peers only (no multicast)")
    p.add_argument("--mdns-interface", action="append", default=[], help="IP of an interface for mDNS (repeatable)")
    p.add_argument("--http-host", default="127.0.0.1", help="HTTP bind address (default: %(default)s)")
    p.add_argument("--http-port", type=int, default=8080, help="HTTP port (0: any free port; default: %(default)s)")
    p.add_argument(
        "--policy",
        default="auto",
        choices=["auto", "sequential", "shuffle", "fastest"],
        help="default path policy (auto: shuffle for shuffle-robust families)",
    )
    p.add_argument("--min-blocks", type=int, default=1, help="fail (503) below this depth (default: %(default)s)")
    p.add_argument(
        "--exit-rule",
        default="calibrated",
        choices=["calibrated", "none", "confidence", "entropy", "patience"],
        help="default early exit: calibrated (the model dir's adaptive.json from `layerswarm eval --calibrate`, "
        "none without one), none, or a rule (default: %(default)s)",
    )
    p.add_argument("--exit-threshold", type=float, help="threshold of --exit-rule (default: its calibrated one)")
    p.add_argument("--hop-timeout", type=float, default=2.0, help="seconds per hop before substituting")
    p.add_argument("--request-timeout", type=float, default=10.0, help="seconds per request, all hops")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument(
        "--hedge-quantile",
        type=float,
        default=0.95,
        help="hedge a hop slower than this quantile of its node's recent latencies: send it to another "
        "node too, first answer wins (0: off; default: %(default)s)",
    )
    p.add_argument(
        "--hedge-min-ms", type=float, default=10.0, help="never hedge sooner than this (default: %(default)s)"
    )
    p.add_argument(
        "--wire-dtype",
        default="fp16",
        choices=["fp32", "fp16", "bf16"],
        help="activations on the wire (default fp16: half the bytes, no accuracy lost on the shipped "
        "family; fp32 for bit-exact outputs)",
    )
    p.add_argument(
        "--transport",
        default="stream",
        choices=["stream", "unary"],
        help="stream: reused bidirectional streams (default); unary: one call per hop",
    )
    p.add_argument("--max-upload-bytes", type=int, default=4 * 1024 * 1024, help="largest image accepted")
    p.add_argument(
        "--state-file",
        type=Path,
        help="where to remember the last known peers, looked at first after a restart (hints only; default: "
        "$XDG_STATE_HOME/layerswarm/coordinator-HTTP_PORT.json, none with --http-port 0)",
    )
    p.add_argument("--no-state-file", action="store_true", help="do not remember peers across restarts")
    add_security_args(p)


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, help="how many nodes (default: two models per block)")
    p.add_argument("--kill", type=int, help="how many nodes to SIGKILL mid-run (default: a third)")
    p.add_argument("--requests", type=int, default=40, help="requests before and after the kills (each)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.add_argument(
        "--network",
        choices=["auto", "netns", "loopback"],
        default="auto",
        help="netns: mDNS inside a private network namespace; loopback: static peers on 127.0.0.1, "
        "no multicast; auto: netns when possible (default)",
    )
    p.add_argument("--family-dir", type=Path, help="folder of model directories (default: the shipped family)")
    p.add_argument("--seed", type=int, default=0)
