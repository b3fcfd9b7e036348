"""Secure by default: a server bound beyond loopback needs a swarm token or TLS, or an explicit --insecure.

Without either, anyone who can reach the port can call `Forward` on a node, or join a coordinator's swarm
as a node (membership is then unauthenticated: docs/trust.md). That is fine on loopback, where only this
machine's processes reach it (`layerswarm up`, the tests), and a choice the operator must make out loud
everywhere else: a node or coordinator bound to any other address refuses to start unless told
`--insecure`, and then says so in its log, in `/v1/nodes` and on the swarm page.
"""

from __future__ import annotations

import ipaddress

from .security import SecuritySettings

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
INSECURE_HELP = (
    "serve on a non-loopback address without a swarm token or TLS (anyone on that network can then call "
    "or join; said in the log, /v1/nodes and the swarm page). Without it such a server refuses to start"
)


def is_loopback(host: str) -> bool:
    """Whether binding `host` reaches only this machine: 127.0.0.0/8, ::1 or a loopback name. Anything
    else counts as exposed, the wildcards 0.0.0.0 and :: and names we would have to resolve included."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, security: SecuritySettings, insecure: bool, host_flag: str) -> str | None:
    """Why a server may not bind `host` (None: it may): not loopback, no token, no TLS, no --insecure."""
    if is_loopback(host) or security.token or security.tls or insecure:
        return None
    return (
        f"{host_flag} {host} is reachable beyond this machine and there is neither --token-file nor --tls-cert: "
        "anyone on that network could call or join the swarm. Give --token-file FILE (`layerswarm token FILE` "
        "makes one; give every node and the coordinator the same file) or, on a network you trust, --insecure"
    )


def insecure_notice(host: str, security: SecuritySettings, insecure: bool) -> str | None:
    """What the log, /v1/nodes and the page say about a server that runs exposed on --insecure (None: it
    does not: loopback, or a token or TLS guards it)."""
    if is_loopback(host) or security.token or security.tls or not insecure:
        return None
    return f"--insecure: serving on {host} without a swarm token or TLS: anyone on that network can call or join"
