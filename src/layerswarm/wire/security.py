"""Who may talk to a node: a shared swarm token (never sent: per-call MACs, see wire/auth.py) and/or
mutual TLS.

Both sides load the same settings: `SecuritySettings.from_files(...)`. The token guards every
BlockNode call (Forward, ForwardStream, Relay, Collect, and generation's Decode, DecodeStream and
Release) but Info, which is the token's handshake; the standard health service stays open so that
container and Kubernetes probes work without secrets. With TLS, nodes require a client certificate
signed by the swarm's CA, and the coordinator checks the node's certificate against the same CA
(node certificates carry the shared name `layerswarm-node`, so nodes may change addresses). Roles
are separate: node certificates are for serverAuth only and the coordinator's for clientAuth only
(deploy/make-certs.sh), and TLS checks the extended key usage, so a node's key cannot drive nodes.
For relay chains a node also holds a relay certificate (clientAuth, name `layerswarm-relay`): with it
a node may call the next node's Relay (whose chain the coordinator MACed) and Info (its proof), never
Forward, ForwardStream, Collect or generation's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .auth import NodeAuthenticator, info_identity
from .discovery import METHOD_PREFIX

log = logging.getLogger(__name__)
NODE_TLS_NAME = "layerswarm-node"
COORDINATOR_TLS_NAME = "layerswarm-coordinator"  # the only client certificate that may call all of BlockNode
RELAY_TLS_NAME = "layerswarm-relay"  # a node forwarding a chain: Relay, RelayStream and Info only
RELAY_METHODS = frozenset({METHOD_PREFIX + "Relay", METHOD_PREFIX + "RelayStream", METHOD_PREFIX + "Info"})
PROTECTED_PREFIX = METHOD_PREFIX


@dataclass(frozen=True)
class SecuritySettings:
    token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_ca: bytes | None = None
    relay_cert: bytes | None = None  # a node's client certificate for relay chains (under TLS)
    relay_key: bytes | None = None

    @classmethod
    def from_files(
        cls,
        token_file: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        ca: Path | None = None,
        relay_cert: Path | None = None,
        relay_key: Path | None = None,
    ) -> SecuritySettings:
        tls = [cert, key, ca]
        if any(tls) and not all(tls):
            raise ValueError("TLS needs all three of --tls-cert, --tls-key and --tls-ca")
        if bool(relay_cert) != bool(relay_key):
            raise ValueError("a relay certificate needs both --tls-relay-cert and --tls-relay-key")
        if relay_cert and not all(tls):
            raise ValueError("--tls-relay-cert is for mutual TLS: give --tls-cert, --tls-key and --tls-ca too")
        token = token_file.read_text().strip() if token_file else None
        if token_file and not token:
            raise ValueError(f"--token-file {token_file} is empty")
        return cls(
            token=token,
            tls_cert=cert.read_bytes() if cert else None,
            tls_key=key.read_bytes() if key else None,
            tls_ca=ca.read_bytes() if ca else None,
            relay_cert=relay_cert.read_bytes() if relay_cert else None,
            relay_key=relay_key.read_bytes() if relay_key else None,
        )

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.tls_key and self.tls_cert
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)], root_certificates=self.tls_ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca, private_key=self.tls_key, certificate_chain=self.tls_cert
        )

    def relay_channel_credentials(self) -> grpc.ChannelCredentials:
        """A node's credentials towards the next node of a chain (its relay certificate)."""
        assert self.relay_cert and self.relay_key
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca, private_key=self.relay_key, certificate_chain=self.relay_cert
        )


class CoordinatorRoleInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    """With TLS: BlockNode calls from the coordinator's certificate (its common name), and Relay and
    Info from a node's relay certificate; other client certificates of the swarm (a probe's) reach the
    health service only."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(PROTECTED_PREFIX):
            return handler
        allowed = {COORDINATOR_TLS_NAME, RELAY_TLS_NAME} if method in RELAY_METHODS else {COORDINATOR_TLS_NAME}
        return _require_role(handler, allowed)


def _client_name_in(context: grpc.aio.ServicerContext, allowed: set[str]) -> bool:
    names = context.auth_context().get("x509_common_name", [])
    return any(n.decode(errors="replace") in allowed for n in names)


async def _refuse_role(context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.PERMISSION_DENIED,
        "only the coordinator's certificate may call this BlockNode method "
        "(a relay certificate: Relay, RelayStream and Info)",
    )


def _require_role(handler: Any, allowed: set[str]) -> Any:
    """The handler, behind a check of the client certificate's name (BlockNode has unary calls and
    server-streaming ones, with one request or a stream of them; node/guard.py hands every one over
    request-streaming)."""

    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    for kind, make in (
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ):
        if (inner_stream := getattr(handler, kind)) is not None:

            async def replies(
                request: Any,
                context: grpc.aio.ServicerContext,
                inner: Any = inner_stream,
                many: bool = kind == "stream_stream",
            ) -> Any:
                if not _client_name_in(context, allowed):
                    if many:  # a stream of requests: let the caller's first one in before refusing
                        await _first_message_in(request)
                    await _refuse_role(context)
                async for reply in inner(request, context):
                    yield reply

            return make(replies, **codec)
    if (inner_many := handler.stream_unary) is not None:

        async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            if not _client_name_in(context, allowed):
                await _first_message_in(requests)  # as for a stream: the caller's message in first
                await _refuse_role(context)
            return await inner_many(requests, context)

        return grpc.stream_unary_rpc_method_handler(call, **codec)
    inner = handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not _client_name_in(context, allowed):
            await _refuse_role(context)
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, **codec)


FIRST_MESSAGE_WAIT_S = 0.5  # how long a refused stream waits for the caller's first message


async def _first_message_in(requests: Any) -> None:
    """Reads the caller's first message (if it writes one within FIRST_MESSAGE_WAIT_S) before a
    refusal: ending a call while its caller is still writing makes grpc.aio's client report its own
    INTERNAL ("Internal error from Core") instead of our status."""
    with contextlib.suppress(asyncio.TimeoutError, StopAsyncIteration):
        await asyncio.wait_for(anext(aiter(requests)), FIRST_MESSAGE_WAIT_S)


def deny(method: str, reason: str, trailing: tuple[tuple[str, str], ...], read_first: bool = True) -> Any:
    """A refusal with UNAUTHENTICATED (node/guard.py decides who gets one). `read_first`: after the
    caller's (first) message is in, for a caller we want to hear the refusal: a call ended while its
    caller is still writing can make grpc.aio's client report its own INTERNAL ("Internal error from Core")
    instead (seen under load in the replay tests), and a coordinator then cannot tell a refusal, whose
    trailing metadata carries the node's new challenge, from a failure. Without it the message is never
    read: what a stranger without the token gets (its max-size message is not buffered)."""

    async def abort(context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"swarm authentication: {reason}", trailing)

    async def deny_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        # The caller's first message in, if it writes one at once; a caller that waits for our answer
        # first (a RelayStream waits to be accepted) gets it after the wait.
        if read_first:
            await _first_message_in(requests)
        await abort(context)
        yield  # pragma: no cover - abort raises; this makes the function an async generator

    async def deny_call(requests: Any, context: grpc.aio.ServicerContext) -> None:
        if read_first:
            await _first_message_in(requests)
        await abort(context)

    # Request-streaming either way: grpc.aio reads a unary call's message before its handler runs.
    if method.endswith("Stream"):
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    return grpc.stream_unary_rpc_method_handler(deny_call)


def with_proof(handler: Any, auth: NodeAuthenticator, nonce: str | None) -> Any:
    """The Info handler, whose reply carries our challenge, clock and proof in its trailing metadata."""
    inner = handler.unary_unary

    async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
        reply = await inner(request, context)
        identity = info_identity(reply)
        context.set_trailing_metadata(auth.info_metadata(nonce, identity))
        return reply

    return grpc.unary_unary_rpc_method_handler(
        behaviour, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
