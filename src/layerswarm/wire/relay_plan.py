"""The MAC over a relay chain: what lets a node forward at all (docs/relay.md).

A node forwards only along a chain the coordinator MACed with the swarm key, K (wire/auth.py): the
MAC covers the request id, the issue time, where the result goes (kept by the last node for the
coordinator's Collect, or sent back along the chain) and every step (address, position, block, trace
key), so nothing on the way can add a hop, point a hop elsewhere, stretch the chain, swap a key or
divert the result. Chains are
bounded in length by the node (`MAX_RELAY_HOPS`) and every forwarded message by its message size
limit, so a node can never be used as an open proxy, even by a caller that holds a valid call signature.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from .v1 import block_pb2 as pb

MAX_RELAY_HOPS = 64  # steps in one chain: a block index runs at most once per path (plus repeats)
HANDBACK_MARGIN_S = 0.25  # at most; a hand-back of a 302 KB activation takes 24 ms at 100 Mbit/s
REST_SLACK = 1.25  # rest_wait_s: each later step's hop timeout, and a quarter of one more for the way back


class PlanError(Exception):
    """A chain the node refuses to act on; the message says why."""


def chain_text(request_id: str, issued_ms: int, chain: Sequence[pb.RelayStep], collect: bool) -> str:
    # A step's trace key is MACed too: the node before it checks its entry with it, so a node that
    # could swap a later step's key would have honest nodes refuse honest entries. And `collect`: a
    # node that could clear it would have the last node send its result back along the chain while
    # the coordinator waited on Collect for it, and blamed the last node.
    steps = ";".join(f"{s.address},{s.position},{s.block}{_key_text(s.trace_key)}" for s in chain)
    return f"relay|{request_id}|{issued_ms}|{'collect' if collect else 'return'}|{steps}"


def _key_text(key: bytes) -> str:
    return f",{key.hex()}" if key else ""  # none: the text chains had before keys were in them


def plan_mac(key: bytes, request_id: str, issued_ms: int, chain: Sequence[pb.RelayStep], *, collect: bool) -> str:
    return hmac.new(key, chain_text(request_id, issued_ms, chain, collect).encode(), hashlib.sha256).hexdigest()


def valid_address(address: str) -> bool:
    host, _, port = address.rpartition(":")
    # ASCII digits only: "²" is a digit to str.isdigit but raises in int()
    return bool(host) and len(address) <= 255 and port.isascii() and port.isdigit() and 0 < int(port) < 65536


def check_plan(key: bytes, request: pb.RelayRequest, max_hops: int = MAX_RELAY_HOPS) -> None:
    """Raise PlanError unless `request`'s chain is well formed and MACed with `key`."""
    chain = list(request.chain)
    if not chain or len(chain) > max_hops:
        raise PlanError(f"chain of {len(chain)} steps (1 to {max_hops} allowed)")
    if not 0 <= request.index < len(chain):
        raise PlanError(f"index {request.index} outside the chain of {len(chain)} steps")
    bad = [s.address for s in chain if not valid_address(s.address)]
    if bad:
        raise PlanError(f"malformed step address {bad[0]!r}")
    if chain[request.index].position != request.forward.position:
        raise PlanError("the hop's position differs from the chain's")
    expected = plan_mac(key, request.forward.request_id, request.issued_ms, chain, collect=request.collect)
    if not hmac.compare_digest(request.plan_mac, expected):
        raise PlanError("chain not MACed with our swarm key (not issued by our coordinator)")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rest_wait_s(steps_after: int, hop_timeout_s: float) -> float:
    """How long the caller of a chain's node waits for that node's final event once it has acknowledged:
    each of the `steps_after` steps after it may take the hop timeout to acknowledge (the rule every
    node holds the next one to), with a quarter of it to spare each, and a quarter for the final
    event's way back. The waits nest: a node that goes silent after acknowledging (power lost, a link
    cut: no connection reset) is handed back by the node before it a quarter of a hop timeout before
    that node's own caller would give up, so the hand-back names it while the request still has time
    to go on. Before, every such wait ran to the chain's deadline, which is the request's: a node lost
    at the wrong moment cost the request its whole deadline, and with it the answer."""
    return hop_timeout_s * (REST_SLACK * max(steps_after, 0) + REST_SLACK - 1)


def handback_margin_s(deadline_s: float) -> float:
    """How long before a chain's deadline a node stops waiting for the rest of it, so that its hand-back
    (a small event and one activation, over one hop) reaches its caller before the caller stops waiting
    in turn. Without it all waits along a chain ended together, and the caller of a node that
    acknowledged and then withheld its final event timed out first, blaming its own next node (the
    coordinator: the chain's first node) while the one stalling was never named. A protocol rule, not a
    node's choice: the coordinator counts on it when it checks the deadline a claimer was given
    (coordinator/relay/handbacks.py: given_times_problem)."""
    return min(HANDBACK_MARGIN_S, max(deadline_s, 0.0) / 8)
