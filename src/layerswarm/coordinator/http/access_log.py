"""An optional access log: one line per HTTP request (method, path, status, duration, request id).

Off by default (`--access-log`): at a few hundred requests a second it is most of the log. Every
response carries `X-Request-Id` either way, so a client's report can be matched to the coordinator's
log: the client's own id when it sent a sane one, else a fresh one.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("layerswarm.access")
REQUEST_ID = "x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # anything else is replaced: ids go into logs verbatim


def request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID.encode():
            text = value.decode("latin-1")
            if _SANE_ID.fullmatch(text):
                return text
    return uuid.uuid4().hex[:16]


class AccessLog:
    """ASGI middleware: tags each response with its request id and, when `enabled`, logs it at INFO."""

    def __init__(self, app: ASGIApp, enabled: bool) -> None:
        self.app, self.enabled = app, enabled
        if enabled:  # its own level: the log line shows whatever the process's level is (WARNING by default)
            log.setLevel(logging.INFO)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid, started, status = request_id(scope), time.perf_counter(), 0

        async def tagged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message["headers"] = [*message.get("headers", []), (REQUEST_ID.encode(), rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            if self.enabled:
                self._log(scope, status, (time.perf_counter() - started) * 1e3, rid)

    @staticmethod
    def _log(scope: Scope, status: int, ms: float, rid: str) -> None:
        client = scope.get("client") or ("-", 0)
        fields: dict[str, Any] = {
            "method": scope.get("method", "-"),
            "path": scope.get("path", "-"),
            "status": status,  # 0: the client went away before any response
            "duration_ms": round(ms, 2),
            "request_id": rid,
            "client": client[0],
        }
        log.info("%s %s %d %.1f ms id=%s client=%s", *fields.values(), extra={"fields": fields})
