"""The swarm page with API keys on: a browser opening `/` cannot send an Authorization header.

GET /login serves a form; POST /login, given one of the coordinator's keys, sets a session cookie and
sends the browser to the page. The front door (front_door.py) accepts that cookie in place of a key for
the page only: `/`, its assets, /v1/swarm and /v1/events. Never for the API: a browser sends a cookie by
itself, and an API call should carry its key. The cookie is HttpOnly (no script reads it) and
SameSite=Strict (no other site's page makes the browser send it), Secure when the page came over HTTPS.

It holds no key: an expiry signed with a secret this process drew at start (HMAC-SHA256), so nothing is
stored per browser, and a restart (a changed key file takes one) logs every browser out.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from .api_keys import ApiKeys
from .errors import ApiError

COOKIE = "layerswarm_page"
SESSION_S = 12 * 3600  # a working day: then the form again
MAX_FORM_BYTES = 4096  # a key field and some: a larger body is not a login
PAGE_PATHS = frozenset({"/", "/v1/swarm", "/v1/events"})
PAGE_PREFIXES = ("/static/",)  # the page's script and styles
_TOKEN = re.compile(r"([0-9]{1,12})\.([0-9a-f]{64})")

FORM = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>layerswarm: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">
<style>body{font:16px system-ui,sans-serif;max-width:28em;margin:4em auto;padding:0 1em}
input{font:inherit;width:100%;box-sizing:border-box;margin:.5em 0;padding:.4em}</style></head>
<body><h1>layerswarm</h1><p>This coordinator needs an API key (a line of its <code>--api-key-file</code>)
to show the swarm page.</p>
<form method="post" action="/login"><label for="key">API key</label>
<input id="key" name="key" type="password" autocomplete="current-password" required autofocus>
<input type="submit" value="Open the swarm page"></form></body></html>
"""


class PageSessions:
    """Signed session cookies for the swarm page."""

    def __init__(self, ttl_s: float = SESSION_S, clock: Callable[[], float] = time.time) -> None:
        self._secret = secrets.token_bytes(32)
        self.ttl_s, self.clock = ttl_s, clock

    def issue(self) -> str:
        expires = int(self.clock() + self.ttl_s)
        return f"{expires}.{self._mac(expires)}"

    def valid(self, token: str) -> bool:
        match = _TOKEN.fullmatch(token)
        if match is None:
            return False
        expires = int(match.group(1))
        return hmac.compare_digest(match.group(2), self._mac(expires)) and expires > self.clock()

    def admits(self, path: str, headers: dict[bytes, bytes]) -> bool:
        """Whether a request for `path` may go without a key: a page path, with a valid session cookie."""
        if path not in PAGE_PATHS and not path.startswith(PAGE_PREFIXES):
            return False
        token = cookie_value(headers.get(b"cookie", b""), COOKIE)
        return token is not None and self.valid(token)

    def _mac(self, expires: int) -> str:
        return hmac.new(self._secret, str(expires).encode(), hashlib.sha256).hexdigest()


def cookie_value(header: bytes, name: str) -> str | None:
    """One cookie's value from a Cookie header; None when absent. Never raises on a malformed header."""
    for pair in header.decode("latin-1").split(";"):
        key, sep, value = pair.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"')
    return None


def mount_login(app: FastAPI, keys: ApiKeys, sessions: PageSessions) -> None:
    @app.get("/login", include_in_schema=False)
    async def form() -> Response:
        if not keys.enabled:  # no keys: the page is open
            return RedirectResponse("/", status_code=303)
        return HTMLResponse(FORM, headers={"Cache-Control": "no-store"})

    @app.post("/login", tags=["swarm page"], responses={303: {}, 401: {}, 413: {}})
    async def login(request: Request) -> Response:
        """Form field `key`: one of the API keys. Sets the swarm page's session cookie and redirects to
        `/`; a wrong key is a 401."""
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                raise ApiError(413, "too_large", f"a login form is at most {MAX_FORM_BYTES} bytes")
        key = parse_qs(body.decode("utf-8", "replace")).get("key", [""])[0]
        if not keys.enabled:
            return RedirectResponse("/", status_code=303)
        if not key:
            raise ApiError(400, "invalid_request", "send the form field key: one of the coordinator's API keys")
        if not keys.matches(key):
            raise ApiError(401, "unauthorized", "the API key is not one of this coordinator's keys")
        reply = RedirectResponse("/", status_code=303)
        reply.set_cookie(
            COOKIE,
            sessions.issue(),
            max_age=int(sessions.ttl_s),
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return reply
