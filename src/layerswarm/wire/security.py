"""Who may talk to a node: a shared swarm token (gRPC metadata) and/or mutual TLS.

Both sides load the same settings: `SecuritySettings.from_files(...)`. The token guards the
BlockNode service (Forward, ForwardStream, Info); the standard health service stays open so that
container and Kubernetes probes work without secrets. With TLS, nodes require a client certificate
signed by the swarm's CA, and the coordinator checks the node's certificate against the same CA
(node certificates carry the shared name `layerswarm-node`, so nodes may change addresses).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

NODE_TLS_NAME = "layerswarm-node"
PROTECTED_PREFIX = "/layerswarm.v1.BlockNode/"


@dataclass(frozen=True)
class SecuritySettings:
    token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_ca: bytes | None = None

    @classmethod
    def from_files(
        cls, token_file: Path | None = None, cert: Path | None = None, key: Path | None = None, ca: Path | None = None
    ) -> SecuritySettings:
        tls = [cert, key, ca]
        if any(tls) and not all(tls):
            raise ValueError("TLS needs all three of --tls-cert, --tls-key and --tls-ca")
        token = token_file.read_text().strip() if token_file else None
        if token_file and not token:
            raise ValueError(f"--token-file {token_file} is empty")
        return cls(
            token=token,
            tls_cert=cert.read_bytes() if cert else None,
            tls_key=key.read_bytes() if key else None,
            tls_ca=ca.read_bytes() if ca else None,
        )

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.tls_key and self.tls_cert
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)], root_certificates=self.tls_ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca, private_key=self.tls_key, certificate_chain=self.tls_cert
        )


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    """Answers UNAUTHENTICATED to BlockNode calls without the swarm token (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        method = handler_call_details.method
        if not method.startswith(PROTECTED_PREFIX):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = str(metadata.get("authorization", "")).encode()
        if hmac.compare_digest(given, self._expected):
            return await continuation(handler_call_details)
        return _deny_stream if method.endswith("Stream") else _deny_unary


async def _abort(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong swarm token")


async def _deny_unary_behaviour(request: Any, context: grpc.aio.ServicerContext) -> None:
    await _abort(context)


async def _deny_stream_behaviour(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    await _abort(context)
    yield  # pragma: no cover - abort raises; this makes the function an async generator


_deny_unary = grpc.unary_unary_rpc_method_handler(_deny_unary_behaviour)
_deny_stream = grpc.stream_stream_rpc_method_handler(_deny_stream_behaviour)
