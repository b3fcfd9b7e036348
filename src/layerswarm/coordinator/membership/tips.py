"""Convictions told to the other coordinators as tips, never as verdicts (pure logic: no I/O).

Several coordinators may serve one swarm, each on its own (docs/deploy.md). One that convicts a node
tells the others (`--coordinator-peer URL`), so that they do not relearn it the hard way. But a tip is
a claim, and every member of the swarm holds the token that signs it, a node included: a compromised
node could sign a tip against an honest one. So a tip convicts nobody. The coordinator that receives
one re-executes the named node's next TIP_HOPS hops (verification/verifier.py: `tip`): a liar is caught
at its next lie there, on that coordinator's own evidence, and an honest node costs TIP_HOPS
re-executions. One tip per address per TIP_COOLDOWN_S is acted on, so a flood of signed tips buys a
bounded share of checks; a tip without a valid MAC, outside the clock window or replayed is refused.

Wire: `POST /v1/swarm/tips`, a JSON object (Tip's fields) signed in the header MAC_HEADER: hex
HMAC-SHA256 over the body's bytes, keyed by the token (a key of its own: a tip's MAC is no call's).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass

from layerswarm.wire.auth import derive_key

TIP_HOPS = 8  # hops of a tipped node re-executed by the coordinator told
TIP_COOLDOWN_S = 60.0  # one tip per address acted on in this long
WINDOW_S = 60.0  # a tip is accepted this long either side of our clock
MAX_TIP_BYTES = 2048  # a tip is a few hundred bytes
MAX_REMEMBERED = 4096  # nonces and addresses remembered (oldest go first)
MAC_HEADER = "x-layerswarm-tip-mac"
_LIMITS = {"address": 255, "boot_id": 128, "reason": 500, "nonce": 64, "sender": 255}


class TipError(ValueError):
    """A tip refused: `status` is the HTTP status to answer with (400 malformed, 401 not proved)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class Tip:
    address: str  # the convicted node (HOST:PORT, as the sender routes to it)
    boot_id: str  # the incarnation convicted
    reason: str  # the sender's evidence in words (for the log: the receiver checks for itself)
    sent_ms: int  # the sender's clock, Unix milliseconds
    nonce: str  # hex, fresh per tip
    sender: str  # the sender's own URL (for the log)

    def body(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


def tip_key(token: str) -> bytes:
    return hmac.new(derive_key(token), b"layerswarm coordinator tips v1", hashlib.sha256).digest()


def sign(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def new_tip(address: str, boot_id: str, reason: str, sender: str, now_s: float) -> Tip:
    return Tip(address, boot_id, reason[: _LIMITS["reason"]], int(now_s * 1000), secrets.token_hex(16), sender)


def parse(body: bytes) -> Tip:
    """A tip from its JSON, every field checked (TipError 400 otherwise)."""
    if len(body) > MAX_TIP_BYTES:
        raise TipError(400, f"a tip is at most {MAX_TIP_BYTES} bytes")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise TipError(400, f"not JSON: {exc}") from exc
    if not isinstance(data, dict) or set(data) != {*_LIMITS, "sent_ms"}:
        raise TipError(400, f"a tip is an object with exactly {sorted({*_LIMITS, 'sent_ms'})}")
    for name, limit in _LIMITS.items():
        if not isinstance(data[name], str) or not 0 < len(data[name]) <= limit:
            raise TipError(400, f"{name}: a string of 1 to {limit} characters")
    if type(data["sent_ms"]) is not int:
        raise TipError(400, "sent_ms: an integer (Unix milliseconds)")
    return Tip(**data)


class TipInbox:
    """Checks tips and says which to act on: `accept` raises TipError, or returns the tip (None when its
    node was tipped within the cooldown: accepted, not acted on again)."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self.clock = clock
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> when seen
        self._acted: OrderedDict[str, float] = OrderedDict()  # address -> when its last tip was acted on

    def accept(self, body: bytes, mac: str | None) -> Tip | None:
        if mac is None or not hmac.compare_digest(mac.encode(), sign(self.key, body).encode()):
            raise TipError(401, f"no valid {MAC_HEADER}: tips are signed with the swarm token")
        tip = parse(body)
        now = self.clock()
        if abs(now - tip.sent_ms / 1000) > WINDOW_S:
            raise TipError(401, f"sent_ms is more than {WINDOW_S:.0f} s from our clock")
        if tip.nonce in self._nonces:
            raise TipError(401, "a replayed tip (its nonce was seen)")
        _remember(self._nonces, tip.nonce, now)
        last = self._acted.get(tip.address)
        if last is not None and now - last < TIP_COOLDOWN_S:
            return None
        _remember(self._acted, tip.address, now)
        return tip


def _remember(table: OrderedDict[str, float], key: str, value: float) -> None:
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_REMEMBERED:
        table.popitem(last=False)
