"""The outermost layer of the coordinator's app: API keys (or the page's login cookie), every status
counted, disconnects, bugs.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware): it sees each request before any
route reads its body, so a request without a valid key is refused before a byte of its body is
read, and it counts the status of every answer, errors and refusals included, by route.
"""

from __future__ import annotations

import json
import logging

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..metrics import CoordinatorMetrics
from ..settings import OPEN_PATHS, OPEN_PREFIXES
from .api_keys import ApiKeys
from .guarded_h11 import TIMED_OUT
from .login import PageSessions

log = logging.getLogger(__name__)

REFUSED = "layerswarm.refused"  # scope key: answered by the front door itself, before routing
CLIENT_CLOSED = 499  # nginx's code for "the client went away before the answer": counted, never sent


class FrontDoor:
    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        metrics: CoordinatorMetrics,
        sessions: PageSessions,
        open_paths: frozenset[str] = frozenset(OPEN_PATHS),
    ) -> None:
        self.app = app
        self.keys = keys
        self.sessions = sessions  # the swarm page's login cookie, in place of a key for the page
        self.metrics = metrics
        self.open_paths = open_paths

    def _keyed(self, path: str) -> bool:
        return path not in self.open_paths and not path.startswith(OPEN_PREFIXES)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> str | None:
        if not self.keys.enabled or not self._keyed(path) or self.sessions.admits(path, headers):
            return None
        return self.keys.refusal(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(scope, receive, send)
        try:
            refusal = self._refusal(scope["path"], exchange.headers)
            if refusal is not None and _browser_opening_the_page(scope, exchange.headers):
                scope[REFUSED] = True
                await exchange.redirect("/login")
            elif refusal is not None:
                scope[REFUSED] = True
                await exchange.answer(401, "unauthorized", refusal, bearer=True)
            else:
                await self.app(scope, exchange.receive, exchange.send)
        except ClientDisconnect:
            if TIMED_OUT in scope:  # the protocol answered 408 and closed (and logged why)
                exchange.status = exchange.status or 408
            else:
                log.info("client %s went away during %s %s", _client(scope), scope["method"], scope["path"])
                exchange.status = exchange.status or CLIENT_CLOSED
        except Exception as exc:
            # A bug must not reach the client as a traceback or a dropped connection: log it, answer JSON.
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            if not exchange.status:
                await exchange.answer(500, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            self.metrics.requests.labels(_endpoint(scope), str(exchange.status or CLIENT_CLOSED)).inc()


class _Exchange:
    """One request/response: remembers the status sent and whether the client's body was read to its end."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self.headers = dict(scope["headers"])
        self.body_pending = b"transfer-encoding" in self.headers or self.headers.get(b"content-length", b"0") != b"0"
        self.status = 0

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_pending = False
        if message["type"] == "http.disconnect":
            self.body_pending = False
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self.body_pending:
                # Answered before the body was read (401, 413, 429...): close rather than read the rest.
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await self._send(message)

    async def redirect(self, location: str) -> None:
        headers = [(b"location", location.encode()), (b"content-length", b"0")]
        await self.send({"type": "http.response.start", "status": 303, "headers": headers})
        await self._send({"type": "http.response.body", "body": b""})

    async def answer(self, status: int, error: str, detail: str, bearer: bool = False) -> None:
        body = json.dumps({"error": error, "detail": detail}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if bearer:
            headers.append((b"www-authenticate", b"Bearer"))
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})


def _browser_opening_the_page(scope: Scope, headers: dict[bytes, bytes]) -> bool:
    """A browser's GET of the page without a key: sent to the login form, not shown JSON."""
    return scope["path"] == "/" and scope["method"] == "GET" and b"text/html" in headers.get(b"accept", b"")


def _endpoint(scope: Scope) -> str:
    """The route's path template (bounded label values). A request refused here, before routing (401),
    has none: "unrouted"; a path no route serves (404): "unmatched"."""
    if "route" in scope:
        return getattr(scope["route"], "path", None) or "unmatched"
    return "unrouted" if scope.get(REFUSED) else "unmatched"


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"
