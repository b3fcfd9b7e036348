"""Who is calling: the identity a node binds a generation stream to (a stream id is not a capability).

    principal = "host H"                  without TLS: the caller's address as this node's socket sees it
              = "host H cert F"           with mutual TLS: and the sha256 (first 16 bytes, hex) of the
                                          client certificate the handshake verified

The host alone is what TCP gives: any process on that host (or anyone who can spoof it on the path)
shares it. Under mutual TLS the certificate is proved by its key, but the swarm's coordinators usually
share one certificate (deploy/make-certs.sh): the host is kept beside it so that another coordinator of
the swarm, on another host, is still another caller. docs/generation.md states the guarantee.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Protocol

from .streams import Caller

_connections = itertools.count(1)


class PeerContext(Protocol):
    """What this module reads of a grpc.aio.ServicerContext."""

    def peer(self) -> str: ...
    def auth_context(self) -> dict[str, list[bytes]]: ...


def peer_host(peer: str) -> str:
    """The host part of gRPC's peer string: "ipv4:10.0.0.7:5123" -> "10.0.0.7", "ipv6:[::1]:5123" ->
    "::1", "ipv6:%5B::1%5D:5123" (percent-encoded, some gRPC versions) -> "::1"; anything else whole."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        rest = rest.replace("%5B", "[").replace("%5D", "]")
        if rest.startswith("[") and "]" in rest:
            return rest[1 : rest.index("]")]
        return rest.rpartition(":")[0] or rest
    return peer


def certificate_fingerprint(context: PeerContext) -> str | None:
    """sha256 of the verified client certificate (PEM), first 16 bytes in hex; None without TLS."""
    pem = context.auth_context().get("x509_pem_cert")
    if not pem:
        return None
    return hashlib.sha256(pem[0]).hexdigest()[:32]


def caller_of(context: PeerContext, connection: int | None = None) -> Caller:
    """The caller of one call; `connection` names the DecodeStream it came over (new_connection())."""
    principal = f"host {peer_host(context.peer())}"
    fingerprint = certificate_fingerprint(context)
    if fingerprint is not None:
        principal += f" cert {fingerprint}"
    return Caller(principal, connection)


def new_connection() -> int:
    """A number for one DecodeStream call, unique in this process."""
    return next(_connections)
