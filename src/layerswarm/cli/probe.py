"""`layerswarm probe`: container and systemd health checks without extra tools.

layerswarm probe grpc 127.0.0.1:50051     # grpc.health.v1 Check: exit 0 when SERVING
layerswarm probe http http://127.0.0.1:8080/readyz   # exit 0 on HTTP 2xx
"""

from __future__ import annotations

import argparse

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from layerswarm.wire.discovery import HEALTH_SERVICE
from layerswarm.wire.security import NODE_TLS_NAME, SecuritySettings

from .base import Subparsers, add_command
from .security import add_probe_security_args, probe_security


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
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    add_probe_security_args(p)


def run(args: argparse.Namespace) -> int:
    if args.kind == "grpc":
        healthy, message = probe_grpc(args.target, args.timeout, probe_security(args))
    else:
        healthy, message = probe_http(args.target, args.timeout)
    print(message)
    return 0 if healthy else 1


def probe_grpc(address: str, timeout: float, security: SecuritySettings | None = None) -> tuple[bool, str]:
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
    try:
        reply = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        return False, f"{url}: {exc}"
    return reply.is_success, f"{url}: HTTP {reply.status_code}"
