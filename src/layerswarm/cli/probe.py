"""`layerswarm probe`: container and systemd health checks without extra tools.

layerswarm probe grpc 127.0.0.1:50051     # grpc.health.v1 Check: exit 0 when SERVING
layerswarm probe http http://127.0.0.1:8080/readyz   # exit 0 on HTTP 2xx

A HEALTHCHECK runs this every few seconds in every container, so it must stay light: grpc is imported
only for gRPC probes, HTTP uses the standard library, and nothing here pulls in torch
(tests/deploy/test_deploy.py checks that).
"""

from __future__ import annotations

import argparse
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from layerswarm.wire.discovery import HEALTH_SERVICE

from .base import Subparsers, add_command, positive_float
from .security import add_probe_security_args, probe_security

if TYPE_CHECKING:
    from layerswarm.wire.security import SecuritySettings


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "probe",
        run,
        help="health check a node (gRPC) or coordinator (HTTP); exit 0 if healthy",
        description="For container HEALTHCHECKs and systemd: grpc HOST:PORT asks the standard grpc.health.v1 "
        "service; http URL expects a 2xx.",
    )
    p.add_argument("kind", choices=["grpc", "http"], help="what to ask")
    p.add_argument("target", help="HOST:PORT (grpc) or URL (http)")
    p.add_argument("--timeout", type=positive_float, default=2.0, help="seconds to wait for the answer")
    add_probe_security_args(p)


def run(args: argparse.Namespace) -> int:
    if args.kind == "grpc":
        healthy, message = probe_grpc(args.target, args.timeout, probe_security(args))
    else:
        healthy, message = probe_http(args.target, args.timeout)
    print(message)
    return 0 if healthy else 1


def probe_grpc(address: str, timeout: float, security: SecuritySettings | None = None) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from layerswarm.wire.security import NODE_TLS_NAME

    if security is not None and security.tls:
        options = [("grpc.ssl_target_name_override", NODE_TLS_NAME)]
        channel = grpc.secure_channel(address, security.channel_credentials(), options=options)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def probe_http(url: str, timeout: float) -> tuple[bool, str]:
    if not url.startswith(("http://", "https://")):
        return False, f"{url}: not an http(s) URL"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # the scheme is checked above
            return 200 <= reply.status < 300, f"{url}: HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{url}: {getattr(exc, 'reason', exc)}"
