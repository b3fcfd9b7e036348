"""What a node advertises over mDNS (DNS-SD), shared by node and coordinator.

The TXT record is a membership hint, not proof: the coordinator confirms identity with Info over
gRPC and liveness with health checks before it routes through a node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SERVICE_TYPE = "_layerswarm._tcp.local."
PROTOCOL_VERSION = 1
# Steps in one DecodeBatch message at most (DecodeBatchStream): a node ends a call that sends more with
# INVALID_ARGUMENT; a coordinator splits its steps into messages of at most this many.
MAX_DECODE_BATCH_STEPS = 64
TXT_KEYS = ("family", "model", "block", "variant", "proto", "boot", "sha")
# The gRPC service's full name (proto/layerswarm/v1/block.proto; tests/wire/test_wire.py checks), written once:
# a node reports SERVING under it in grpc.health.v1 ("" is the whole server), and its methods' paths
# (signed calls, the coordinator-only interceptor) start with METHOD_PREFIX.
HEALTH_SERVICE = "layerswarm.v1.BlockNode"
METHOD_PREFIX = f"/{HEALTH_SERVICE}/"
# A node's boot id, in the trailing metadata of its health replies: a check that passes right through a
# quick restart still shows a new process answers, whose identity must be read (and proved) again.
BOOT_KEY = "layerswarm-boot"


@dataclass(frozen=True)
class Advert:
    family: str
    model: str
    block: int
    variant: str
    proto: int
    boot: str
    sha: str  # first 16 hex digits of the block's weights sha256

    def to_txt(self) -> dict[str, str]:
        return {k: str(getattr(self, k)) for k in TXT_KEYS}

    @classmethod
    def from_txt(cls, props: Mapping[bytes, bytes | None] | Mapping[str, str | None]) -> Advert:
        """Parse a TXT record; raises ValueError naming the bad or missing key."""
        text = {_s(k): _s(v) for k, v in props.items() if v is not None}
        missing = [k for k in TXT_KEYS if k not in text]
        if missing:
            raise ValueError(f"TXT record lacks {', '.join(missing)}")
        # Anyone on the LAN writes these, and the coordinator logs them (and reasons built from them):
        # a newline would let an advert forge log lines, such as a node's state change.
        unprintable = [k for k in TXT_KEYS if not text[k].isprintable()]
        if unprintable:
            raise ValueError(f"TXT record has control characters in {', '.join(unprintable)}")
        try:
            block, proto = int(text["block"]), int(text["proto"])
        except ValueError as exc:
            raise ValueError(f"TXT record has a non-integer block or proto: {exc}") from exc
        return cls(text["family"], text["model"], block, text["variant"], proto, text["boot"], text["sha"])


def instance_name(model_id: str, block: int, boot_id: str) -> str:
    """A DNS-SD instance name unique per incarnation: model, block and boot id."""
    return f"{model_id[-8:]}-b{block:02d}-{boot_id[:8]}.{SERVICE_TYPE}"


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
