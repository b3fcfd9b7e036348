"""The swarm token and mutual-TLS flags, shared by node, coordinator and probe."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .base import SettingsFlags, existing_file

if TYPE_CHECKING:  # grpc and the crypto: only a probe with TLS pays for them
    from layerswarm.wire.security import SecuritySettings

HELP = {
    "token_file": "file holding the shared swarm token; it is never sent: calls are signed with MACs derived "
    "from it and nodes prove they hold it too (docs/trust.md); keep it out of the command line",
    "tls_cert": "this process's certificate (PEM) for mutual TLS (deploy/make-certs.sh makes a swarm's)",
    "tls_key": "its private key (PEM)",
    "tls_ca": "the swarm's CA certificate (PEM): peers must be signed by it",
}


RELAY_HELP = {
    "tls_relay_cert": "with mutual TLS and --token-file: this node's relay certificate (PEM, `layerswarm-relay`, "
    "deploy/make-certs.sh), with which it forwards relay chains to the next node "
    "(it can call Relay, RelayStream and Info only)",
    "tls_relay_key": "its private key (PEM)",
}


def add_security_flags(flags: SettingsFlags, relay: bool = False) -> None:
    """The token and TLS flags; `relay`: also a node's relay certificate."""
    for key, text in (HELP | RELAY_HELP if relay else HELP).items():
        flags.add("--" + key.replace("_", "-"), key, text, type=existing_file)


def add_probe_security_args(p: argparse.ArgumentParser) -> None:
    """probe has no settings object: TLS only (the health service needs no token, but TLS is the whole port)."""
    for key in ("tls_cert", "tls_key", "tls_ca"):
        p.add_argument("--" + key.replace("_", "-"), type=existing_file, help=HELP[key])


def probe_security(args: argparse.Namespace) -> SecuritySettings | None:
    """The probe's TLS settings, None without --tls-* (the plain channel needs nothing imported)."""
    if not (args.tls_cert or args.tls_key or args.tls_ca):
        return None
    from layerswarm.wire.security import SecuritySettings

    return SecuritySettings.from_files(None, args.tls_cert, args.tls_key, args.tls_ca)
