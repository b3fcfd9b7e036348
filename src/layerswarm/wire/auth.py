"""Swarm-token authentication in which the token never crosses the wire, in both directions.

Both sides derive a key from the token, K = HMAC-SHA256(token, "layerswarm auth v1"), and use it only
for MACs. Each node has a per-boot random challenge.

Info is the handshake and needs no credentials (it says nothing the mDNS advert does not): the
caller sends a fresh nonce (`x-layerswarm-nonce`); the node answers with its challenge, its clock
and a proof, `HMAC(K, "node|<challenge>|<nonce>|<identity>")`, over the caller's nonce and the
identity it reports (family, model, block, weights hash, boot id), which only a holder of the token
can compute. So the caller learns, in one round trip and before it has sent anything derived from
the token, whether the node is one of ours.

Only then does it sign calls to that node (Forward, ForwardStream, Decode, DecodeStream, Release, ...):

    x-layerswarm-auth: v1.<challenge>.<ts_ms>.<nonce>.<mac>
    mac = HMAC(K, "call|<method>|<challenge>|<ts_ms>|<nonce>")

The node checks that the challenge is its own (a MAC made for another node or another boot is
useless here), the timestamp within its window (by the node's own clock: the caller adopts the
node's clock from the Info reply, so devices need no synchronised time), the nonce unseen (a
bounded replay cache) and the MAC. An impostor thus receives nothing but a random nonce, and a MAC
sniffed on the LAN works once, on one node, for one method, within a minute: its real call.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

from layerswarm.wire.v1 import block_pb2 as pb

AUTH_KEY = "x-layerswarm-auth"
NONCE_KEY = "x-layerswarm-nonce"
CHALLENGE_KEY = "x-layerswarm-challenge"
TIME_KEY = "x-layerswarm-time"
PROOF_KEY = "x-layerswarm-proof"
VERSION = "v1"
WINDOW_S = 60.0  # a signed call is accepted this long (either side of the node's clock)
REPLAY_CACHE_MAX = 65536  # nonces remembered; when full the oldest go and older timestamps are refused
MAX_CLOCK_DIGITS = 16  # a clock in ms has 13 digits until the year 2286; int() refuses 4,301 or more (ValueError)


TOKEN_BYTES = 32  # a new swarm token: 32 random bytes in hex (as deploy/push-nodes.sh makes one)


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def ensure_token_file(path: Path) -> bool:
    """Make `path` hold a new swarm token (mode 600) unless it holds one already; True when made. Safe
    against a concurrent maker (containers sharing a volume): written aside, then linked into place,
    which fails when another got there first, whose token is then the one kept."""
    if path.is_file() and path.read_text().strip():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new_token() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(aside, path)
        except FileExistsError:
            if path.read_text().strip():  # another maker got there first: its token is the one
                return False
            os.replace(aside, path)  # an empty file (`touch`ed): replaced
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)


class AuthError(Exception):
    """Credentials refused; the message says why (it goes back to the caller as the status detail)."""


def derive_key(token: str) -> bytes:
    return hmac.new(token.encode(), b"layerswarm auth v1", hashlib.sha256).digest()


def call_mac(key: bytes, method: str, challenge: str, ts_ms: int, nonce: str) -> str:
    return _mac(key, f"call|{method}|{challenge}|{ts_ms}|{nonce}")


def node_proof(key: bytes, challenge: str, nonce: str, identity: str) -> str:
    return _mac(key, f"node|{challenge}|{nonce}|{identity}")


def identity_string(
    family_id: str, model_id: str, block: int, weights_sha256: str, boot_id: str, trace_key: bytes = b""
) -> str:
    """What a node's proof vouches for: a relay cannot alter these fields of its Info reply. The trace key
    (wire/trace_sign.py) only when the node has one, so older nodes' proofs still check."""
    key = f"|{trace_key.hex()}" if trace_key else ""
    return f"{family_id}|{model_id}|{block}|{weights_sha256}|{boot_id}{key}"


def info_identity(info: pb.NodeInfo) -> str:
    """The identity an Info reply's proof covers (the node signs it, callers check it)."""
    return identity_string(
        info.family_id, info.model_id, info.block_index, info.weights_sha256, info.boot_id, info.trace_key
    )


def valid_clock(text: str) -> bool:
    """Whether a peer's clock field (milliseconds) is one int() takes at once: ASCII digits ("²" is a
    digit to str.isdigit, not to int), and few of them."""
    return text.isascii() and text.isdigit() and len(text) <= MAX_CLOCK_DIGITS


def valid_nonce(nonce: str | None) -> bool:
    return nonce is not None and 16 <= len(nonce) <= 64 and nonce.isalnum()


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
        if len(parts) != 5 or parts[0] != VERSION or not valid_clock(parts[2]):
            raise AuthError("malformed x-layerswarm-auth")
        _, challenge, ts, nonce, mac = parts
        if not hmac.compare_digest(challenge, self.challenge):
            raise AuthError("credentials made for another node or boot (stale challenge)")
        if not valid_nonce(nonce):
            raise AuthError("malformed nonce")
        if not hmac.compare_digest(mac, call_mac(self.key, method, challenge, int(ts), nonce)):
            raise AuthError("wrong MAC: not signed with our swarm token")
        self.replay.admit(nonce, int(ts), self.now_ms())  # only after the MAC: strangers fill no cache
        return nonce

    def signed_by_us(self, method: str, header: str) -> bool:
        """Whether `header` was made with our swarm key for `method`, whatever its challenge, clock or
        nonce: a holder of the token (a coordinator that has not seen our restart yet), not a stranger."""
        parts = header.split(".")
        if len(parts) != 5 or parts[0] != VERSION or not valid_clock(parts[2]) or not valid_nonce(parts[3]):
            return False
        _, challenge, ts, nonce, mac = parts
        return hmac.compare_digest(mac, call_mac(self.key, method, challenge, int(ts), nonce))

    def challenge_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((CHALLENGE_KEY, self.challenge), (TIME_KEY, str(self.now_ms())))

    def info_metadata(self, nonce: str | None, identity: str) -> tuple[tuple[str, str], ...]:
        """Trailing metadata of an Info reply: the challenge and clock, and the proof when asked."""
        if not valid_nonce(nonce):
            return self.challenge_metadata()
        assert nonce is not None
        return (*self.challenge_metadata(), (PROOF_KEY, node_proof(self.key, self.challenge, nonce, identity)))


class CallSigner:
    """The coordinator's side, one per node: checks the node's proof in its Info reply, then signs
    calls to it; refuses to sign anything for a node (or a new boot of it) that has not proved itself."""

    def __init__(self, token: str, clock: Callable[[], float] = time.time) -> None:
        self.key = derive_key(token)
        self.clock = clock
        self.challenge: str | None = None
        self.proven_challenge: str | None = None
        self.offset_ms = 0  # the node's clock minus ours

    @staticmethod
    def new_nonce() -> str:
        return secrets.token_hex(12)

    def learn(self, trailing: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Take the node's challenge (and clock) from a reply or refusal; True when it changed (a new
        boot: it must prove itself again)."""
        challenge = metadata_value(trailing, CHALLENGE_KEY)
        node_ms = metadata_value(trailing, TIME_KEY)
        if not challenge or len(challenge) > 64:
            return False
        if node_ms and valid_clock(node_ms):  # a stranger's reply: an absurd clock is ignored, never raised on
            self.offset_ms = int(node_ms) - int(self.clock() * 1000)
        changed = challenge != self.challenge
        self.challenge = challenge
        return changed

    def accept_info(self, trailing: Iterable[tuple[str, str | bytes]] | None, nonce: str, identity: str) -> bool:
        """Whether an Info reply proves the node holds our token (for this nonce and identity)."""
        trailing = list(trailing or ())
        self.learn(trailing)
        given = metadata_value(trailing, PROOF_KEY) or ""
        ok = self.challenge is not None and hmac.compare_digest(
            given, node_proof(self.key, self.challenge, nonce, identity)
        )
        self.proven_challenge = self.challenge if ok else None
        return ok

    @property
    def proven(self) -> bool:
        return self.challenge is not None and self.challenge == self.proven_challenge

    def forget_proof(self) -> None:
        """Another process answers at the node's address (a new boot id): it proves itself anew."""
        self.proven_challenge = None

    def sign(self, method: str) -> tuple[str, str]:
        """The credentials header for one call to `method` (full gRPC name)."""
        if not self.proven or self.challenge is None:
            raise AuthError("node has not proved it holds the swarm token")
        ts = int(self.clock() * 1000) + self.offset_ms
        nonce = self.new_nonce()
        mac = call_mac(self.key, method, self.challenge, ts, nonce)
        return AUTH_KEY, f"{VERSION}.{self.challenge}.{ts}.{nonce}.{mac}"
