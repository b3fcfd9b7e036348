"""Optional API keys for the coordinator's HTTP API.

Keys come from a file (one a line, `#` comments), so they stay out of the command line and several
can be valid at once: add the new key, move clients over, remove the old one, restart. A client
sends `Authorization: Bearer KEY` or `X-API-Key: KEY` (a browser opening the swarm page logs in once
instead: login.py); the paths open without a key are the settings'
(settings.OPEN_PATHS: the api_keys setting's help lists them). Keys are compared as SHA-256 digests with
`hmac.compare_digest`, against every key each time, so the time taken says nothing about which
key, or how much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

MIN_KEY_CHARS = 16


def read_api_keys(path: Path) -> tuple[str, ...]:
    """The keys in `path`; ValueError (naming the file) when it holds none or a key is too short."""
    keys = tuple(
        line.strip() for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")
    )
    if not keys:
        raise ValueError(f"{path} holds no API key")
    short = [i for i, key in enumerate(keys, 1) if len(key) < MIN_KEY_CHARS]
    if short:
        raise ValueError(f"{path}: key {short[0]} is shorter than {MIN_KEY_CHARS} characters")
    return keys


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


class ApiKeys:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def refusal(self, headers: dict[bytes, bytes]) -> str | None:
        """Why the request is refused (no key, or one not ours), or None when it carries one of ours."""
        if _offered_key(headers) is None:
            return "send an API key: Authorization: Bearer KEY"
        return None if self.allows(headers) else "the API key is not one of this coordinator's keys"

    def allows(self, headers: dict[bytes, bytes]) -> bool:
        """True when the request carries one of the keys (headers: lower-case names, raw values)."""
        offered = _offered_key(headers)
        return offered is not None and self.matches(offered)

    def matches(self, offered: str) -> bool:
        """True when `offered` is one of the keys (the swarm page's login form sends one)."""
        digest = _digest(offered)
        matched = False
        for known in self._digests:  # no early exit: every key is compared every time
            matched |= hmac.compare_digest(digest, known)
        return matched


def _offered_key(headers: dict[bytes, bytes]) -> str | None:
    authorization = headers.get(b"authorization")
    if authorization is not None:
        scheme, _, value = authorization.decode("latin-1").partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None
    api_key = headers.get(b"x-api-key")
    return api_key.decode("latin-1").strip() if api_key is not None else None
