"""`layerswarm node`: serve one block over gRPC, advertised over mDNS."""

from __future__ import annotations

import argparse
import os
import sys

from layerswarm.node.settings import BLAS_THREADS, ENGINES, NodeSettings
from layerswarm.wire.memory import few_arenas, keep_large_buffers

from .base import SettingsFlags, Subparsers, UsageError, add_command, ensure_can_listen, load_settings
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
    f.group("block", "which block this node serves, and on what")
    f.add("--model-dir", "model_dir")
    f.add("--block", "block", type=int)
    f.add("--device", "device")
    f.add("--engine", "engine", choices=ENGINES)
    f.add("--threads", "threads", type=int)
    f.group("serving", "the gRPC server, its limits and its metrics")
    f.add("--host", "host")
    f.add("--port", "port", type=int)
    f.add("--max-in-flight", "max_in_flight", type=int)
    f.add("--max-batch", "max_batch", type=int)
    f.add(
        "--no-micro-batch",
        "micro_batch",
        "compute each request alone, not queued ones as a batch",
        action="store_false",
    )
    f.add(
        "--no-relay-streams",
        "relay_streams",
        "forward relay chains with a Relay call per chain, not over one long-lived stream per next node",
        action="store_false",
    )
    f.add("--max-calls", "max_calls", type=int)
    f.add("--max-calls-per-peer", "max_calls_per_peer", type=int)
    f.add("--max-stranger-calls", "max_stranger_calls", type=int)
    f.add("--max-stranger-calls-per-peer", "max_stranger_calls_per_peer", type=int)
    f.add("--stranger-rate", "stranger_rate", type=float)
    f.add("--max-streams", "max_streams", type=int)
    f.add("--max-cache-mib", "max_cache_mib", type=float)
    f.add("--idle-timeout", "idle_timeout_s", type=float)
    f.add("--grace", "grace_s", type=float)
    f.add("--metrics-port", "metrics_port", type=int)
    f.group("discovery", "how coordinators find this node (mDNS), and the address it tells them")
    f.add("--no-advertise", "advertise", "do not announce over mDNS (static peers only)", action="store_false")
    f.add("--advertise-address", "advertise_address")
    f.add("--mdns-interface", "mdns_interfaces", action="append")
    f.group("security", "the swarm token and mutual TLS (docs/trust.md)")
    add_security_flags(f, relay=True)
    f.add("--insecure", "insecure", action="store_true")


def run(args: argparse.Namespace) -> int:
    settings: NodeSettings = load_settings(args)
    if "numpy" not in sys.modules:
        for name in BLAS_THREADS:
            os.environ.setdefault(name, str(settings.threads))

    from layerswarm.node.advertise import advertised_addresses
    from layerswarm.node.engines import EngineError, choose_engine, serves_decoder
    from layerswarm.node.server import run as serve

    ensure_can_listen(settings.host, settings.port, "--host", "--port")
    ensure_can_listen(settings.host, settings.metrics_port, "--host", "--metrics-port")
    if settings.advertise:
        try:  # the rule the node applies once it serves, here so that a bad value is a usage error
            advertised_addresses(settings.host, settings.advertise_address)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:  # torch or numpy, checked before anything is loaded: a wrong choice is the operator's
        engine = choose_engine(settings.engine, settings.device, serves_decoder(settings.model_dir))
    except EngineError as exc:
        raise UsageError(str(exc)) from None
    if engine == "torch":
        import torch

        torch.set_num_threads(settings.threads)  # once per process, at start-up
    keep_large_buffers()  # activations reuse freed pages instead of faulting in new ones (wire/memory.py)
    few_arenas()  # what a stranger's flood left freed goes back to the kernel (wire/memory.py)
    return serve(settings)
