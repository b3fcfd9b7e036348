"""Swarm-token authentication in which the token never crosses the wire, in both directions.

Both sides derive a key from the token, K = HMAC-SHA256(token, "layerswarm auth v1"), and use it only
for MACs. Each node has a per-boot random challenge. A BlockNode call without valid credentials is
answered UNAUTHENTICATED with the node's challenge and clock in the trailing metadata (nothing
secret: anyone may ask). The caller then signs every call:

    x-layerswarm-auth: v1.<challenge>.<ts_ms>.<nonce>.<mac>
    mac = HMAC(K, "call|<method>|<challenge>|<ts_ms>|<nonce>")

The node checks that the challenge is its own (a MAC made for another node or another boot is
useless here), the timestamp within its window (by the node's own clock: the caller adopts the
node's clock from the challenge reply, so devices need no synchronised time), the nonce unseen (a
bounded replay cache) and the MAC. Mutual: the node's Info reply carries
`x-layerswarm-proof: HMAC(K, "node|<challenge>|<nonce>")` over the caller's fresh nonce, which only
a holder of the token can compute. The coordinator signs Forward calls only for a node that has given
that proof, so an impostor never receives anything but an Info MAC bound to its own challenge.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

AUTH_KEY = "x-layerswarm-auth"
CHALLENGE_KEY = "x-layerswarm-challenge"
TIME_KEY = "x-layerswarm-time"
PROOF_KEY = "x-layerswarm-proof"
VERSION = "v1"
WINDOW_S = 60.0  # a signed call is accepted this long (either side of the node's clock)
REPLAY_CACHE_MAX = 65536  # nonces remembered; when full the oldest go and older timestamps are refused


class AuthError(Exception):
    """Credentials refused; the message says why (it goes back to the caller as the status detail)."""


def derive_key(token: str) -> bytes:
    return hmac.new(token.encode(), b"layerswarm auth v1", hashlib.sha256).digest()


def call_mac(key: bytes, method: str, challenge: str, ts_ms: int, nonce: str) -> str:
    return _mac(key, f"call|{method}|{challenge}|{ts_ms}|{nonce}")


def node_proof(key: bytes, challenge: str, nonce: str) -> str:
    return _mac(key, f"node|{challenge}|{nonce}")


def _mac(key: bytes, message: str) -> str:
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else v
    return None


class ReplayCache:
    """Nonces seen within the window. Bounded: evicting a nonce raises a floor below which every
    timestamp is refused, so an evicted nonce can never be replayed."""

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = REPLAY_CACHE_MAX) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_entries = max_entries
        self._seen: OrderedDict[str, int] = OrderedDict()  # nonce -> ts_ms, in arrival order
        self._floor_ms = -1

    def admit(self, nonce: str, ts_ms: int, now_ms: int) -> None:
        """Raises AuthError for a stale, future or replayed call; remembers the nonce otherwise."""
        if abs(now_ms - ts_ms) > self.window_ms:
            raise AuthError(f"timestamp {(ts_ms - now_ms) / 1000:+.0f} s from the node's clock, outside the window")
        if ts_ms <= self._floor_ms:
            raise AuthError("timestamp older than the node's replay cache")
        while self._seen and next(iter(self._seen.values())) < now_ms - self.window_ms:
            self._seen.popitem(last=False)  # outside the window: refused by the check above anyway
        if nonce in self._seen:
            raise AuthError("replayed call (nonce already used)")
        self._seen[nonce] = ts_ms
        while len(self._seen) > self.max_entries:
            _, evicted_ts = self._seen.popitem(last=False)
            self._floor_ms = max(self._floor_ms, evicted_ts)

    def __len__(self) -> int:
        return len(self._seen)


class NodeAuthenticator:
    """The node's side: verifies signed calls and proves itself to the caller."""

    def __init__(self, token: str, clock: Callable[[], float] = time.time) -> None:
        self.key = derive_key(token)
        self.challenge = secrets.token_hex(16)  # per boot: a MAC for another boot or node is useless
        self.clock = clock
        self.replay = ReplayCache()

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def verify(self, method: str, header: str | None) -> str:
        """Check a call's credentials; returns its nonce, or raises AuthError saying why not."""
        if not header:
            raise AuthError("no swarm credentials (x-layerswarm-auth)")
        parts = header.split(".")
        if len(parts) != 5 or parts[0] != VERSION or not parts[2].isdigit():
            raise AuthError("malformed x-layerswarm-auth")
        _, challenge, ts, nonce, mac = parts
        if not hmac.compare_digest(challenge, self.challenge):
            raise AuthError("credentials made for another node or boot (stale challenge)")
        if not 8 <= len(nonce) <= 64:
            raise AuthError("malformed nonce")
        if not hmac.compare_digest(mac, call_mac(self.key, method, challenge, int(ts), nonce)):
            raise AuthError("wrong MAC: not signed with our swarm token")
        self.replay.admit(nonce, int(ts), self.now_ms())  # only after the MAC: strangers fill no cache
        return nonce

    def refusal_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((CHALLENGE_KEY, self.challenge), (TIME_KEY, str(self.now_ms())))

    def proof(self, nonce: str) -> str:
        return node_proof(self.key, self.challenge, nonce)


class CallSigner:
    """The coordinator's side, one per node: learns the node's challenge, signs calls, and signs
    anything but Info only once the node has proved it holds the token."""

    def __init__(self, token: str, clock: Callable[[], float] = time.time) -> None:
        self.key = derive_key(token)
        self.clock = clock
        self.challenge: str | None = None
        self.proven_challenge: str | None = None
        self.offset_ms = 0  # the node's clock minus ours

    def learn(self, trailing: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Take the challenge (and clock) from a refusal; True when it is new to us."""
        challenge = metadata_value(trailing, CHALLENGE_KEY)
        node_ms = metadata_value(trailing, TIME_KEY)
        if not challenge or len(challenge) > 64:
            return False
        if node_ms and node_ms.isdigit():
            self.offset_ms = int(node_ms) - int(self.clock() * 1000)
        new = challenge != self.challenge
        self.challenge = challenge
        return new

    @property
    def proven(self) -> bool:
        return self.challenge is not None and self.challenge == self.proven_challenge

    def sign(self, method: str) -> tuple[tuple[str, str], str]:
        """Credentials for one call to `method` (full gRPC name) and the nonce they carry."""
        if self.challenge is None:
            raise AuthError("no challenge from this node yet")
        if not method.endswith("/Info") and not self.proven:
            raise AuthError("node has not proved it holds the swarm token")
        ts = int(self.clock() * 1000) + self.offset_ms
        nonce = secrets.token_hex(12)
        mac = call_mac(self.key, method, self.challenge, ts, nonce)
        return (AUTH_KEY, f"{VERSION}.{self.challenge}.{ts}.{nonce}.{mac}"), nonce

    def check_proof(self, trailing: Iterable[tuple[str, str | bytes]] | None, nonce: str) -> bool:
        given = metadata_value(trailing, PROOF_KEY) or ""
        assert self.challenge is not None
        ok = hmac.compare_digest(given, node_proof(self.key, self.challenge, nonce))
        self.proven_challenge = self.challenge if ok else None
        return ok
