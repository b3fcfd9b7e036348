"""`layerswarm node`: serve one block over gRPC, advertised over mDNS."""

from __future__ import annotations

import argparse

from layerswarm.node.settings import NodeSettings

from .base import SettingsFlags, Subparsers, add_command, ensure_port_free, load_settings
from .security import add_security_flags


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "node",
        run,
        help="serve one block over gRPC, advertised over mDNS",
        description="Load one block (sha256-verified), serve it over gRPC with health checks and metrics, "
        "and advertise it as _layerswarm._tcp.local.",
    )
    f = SettingsFlags(p, NodeSettings)
    f.add("--model-dir", "model_dir", "model directory holding the block (or zoo:shapes/layershuffle-0)")
    f.add("--block", "block", "index of the block to serve", type=int)
    f.add("--host", "host", "address to bind (0.0.0.0 on a LAN)")
    f.add("--port", "port", "gRPC port (0: any free port)", type=int)
    f.add("--device", "device", "auto | cpu | cuda | cuda:N")
    f.add("--threads", "threads", "torch threads", type=int)
    f.add("--max-in-flight", "max_in_flight", "past this: RESOURCE_EXHAUSTED", type=int)
    f.add("--max-batch", "max_batch", "largest batch accepted", type=int)
    f.add(
        "--no-micro-batch",
        "micro_batch",
        "compute each request alone, not queued ones as a batch",
        action="store_false",
    )
    f.add("--metrics-port", "metrics_port", "serve Prometheus metrics on this port", type=int)
    f.add("--no-advertise", "advertise", "do not announce over mDNS (static peers only)", action="store_false")
    f.add("--advertise-address", "advertise_address", "address to put in the mDNS record (none: the bound host)")
    f.add("--mdns-interface", "mdns_interfaces", "IP of an interface for mDNS (repeatable; none: all)", action="append")
    f.add("--grace", "grace_s", "seconds to drain on SIGTERM", type=float)
    add_security_flags(f)


def run(args: argparse.Namespace) -> int:
    import torch

    from layerswarm.node.server import run as serve

    settings: NodeSettings = load_settings(args)
    ensure_port_free(settings.host, settings.port, "--port")
    ensure_port_free(settings.host, settings.metrics_port, "--metrics-port")
    torch.set_num_threads(settings.threads)  # once per process, at start-up
    return serve(settings)
