"""Per-node signatures on relay trace entries, so a node cannot rewrite the entries of the nodes after it.

A chain's final event travels back through every node before the one that wrote an entry. With the
swarm key alone (which every node holds) any of them could rewrite a later node's entry (its compute
and forwarding times feed the coordinator's latency and link estimates) and keep the digest chain
consistent. So each node makes an Ed25519 key per boot, reports its public half in `Info.trace_key`
(bound to the node's token proof: `auth.info_identity`), and signs its own entry over the chain's
request id and MAC: the entry cannot be altered, moved to another chain or written by anyone else.
The entry includes the digest of the entries after it as the node passed them back (`rest_digest`),
so a node answers for what it passed on. The coordinator checks every entry against the key of the
node it names, and each node the entry after its own (wire/trace_check.py).

What this does not stop: a node lying in its own entry (caught as before, by verification and the
digest chain), or a node older than this check (no key: its entries are taken unsigned).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from layerswarm.wire.v1 import block_pb2 as pb

VERSION = b"layerswarm hop v1"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class TraceSigner:
    """This boot's key: signs the node's own trace entries."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, hop: pb.HopTrace, request_id: str, plan_mac: str) -> None:
        hop.signature = self._key.sign(hop_message(hop, request_id, plan_mac))


def hop_signed_by(public: bytes, hop: pb.HopTrace, request_id: str, plan_mac: str) -> bool:
    """Whether `hop` is exactly what the holder of `public` signed for this chain."""
    if len(public) != PUBLIC_KEY_BYTES or len(hop.signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(hop.signature, hop_message(hop, request_id, plan_mac))
    except InvalidSignature:
        return False
    return True


def hop_message(hop: pb.HopTrace, request_id: str, plan_mac: str) -> bytes:
    """What a signature covers: the chain (request id and MAC) and every field of the entry but the
    signature. Floats as their exact hex; a new HopTrace field must be added here (a test checks)."""
    fields = (
        request_id,
        plan_mac,
        hop.node,
        str(hop.block),
        str(hop.position),
        hop.compute_ms.hex(),
        hop.send_ms.hex(),
        str(hop.sent_bytes),
        hop.input_sha256,
        hop.output_sha256,
        hop.rtt_ms.hex(),
        hop.rest_sha256,
        hop.given_deadline_s.hex(),
        hop.given_hop_timeout_s.hex(),
    )
    return VERSION + _prefixed(f.encode() for f in fields)


def rest_digest(entries: Sequence[pb.HopTrace], request_id: str, plan_mac: str) -> str:
    """What a node's `rest_sha256` is: sha256 over the entries after its own, each with its signature,
    exactly as it passes them back. Signed into its own entry, it makes the node answerable for them:
    the first entry of a trace whose rest does not match what arrived was signed before someone altered
    what follows it (coordinator/relay/chain_trace.py: `trace_problem`)."""
    return hashlib.sha256(b"".join(_entry_bytes(e, request_id, plan_mac) for e in entries)).hexdigest()


def rest_digests(entries: Sequence[pb.HopTrace], request_id: str, plan_mac: str) -> list[str]:
    """`rest_digest(entries[k:])` for every k in 0..len(entries), each entry serialised once (the
    coordinator checks every entry's rest: re-serialising each suffix would be O(n^2) messages)."""
    parts = [_entry_bytes(e, request_id, plan_mac) for e in entries]
    return [hashlib.sha256(b"".join(parts[k:])).hexdigest() for k in range(len(parts) + 1)]


def _entry_bytes(entry: pb.HopTrace, request_id: str, plan_mac: str) -> bytes:
    return _prefixed((hop_message(entry, request_id, plan_mac) + entry.signature,))


def _prefixed(parts: Iterable[bytes]) -> bytes:
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)  # length-prefixed: unambiguous
