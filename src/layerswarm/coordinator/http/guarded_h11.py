"""uvicorn's h11 protocol with deadlines for receiving a request, and a cap on open connections.

uvicorn has no request-receipt timeout: `timeout_keep_alive` is armed only after a response and is
cancelled by any byte received, and an ASGI middleware runs only once the headers are parsed. So a
client that connects and sends nothing, or trickles a header byte a second (slow loris), holds its
connection and file descriptor for ever; 1,000 of them exhausted the coordinator's descriptors.
This protocol arms one deadline per phase of the client's side of the exchange, from h11's state:

- waiting for the request line and headers (a new connection, or the next request on a kept-alive
  one): `header_timeout_s`, not reset by trickled bytes;
- receiving the body: `body_timeout_s` for the whole body.

On expiry it answers 408 (JSON) when no response has started, and closes the connection. Past
`max_connections` open connections, a new one is answered 503 and closed at once, so descriptors
stay free for the gRPC connections to the nodes. Time spent computing an answer is never limited.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

HEAD, BODY = "header", "body"
LINGER_S = 2.0  # after an early answer, how long the rest of a body is read and discarded
TIMED_OUT = "layerswarm.timed_out"  # scope key: set when this protocol answered 408 for a request the app holds


def guarded_protocol(
    header_timeout_s: float, body_timeout_s: float, max_connections: int, on_close: Callable[[str], None]
) -> type[H11Protocol]:
    """An H11Protocol class with these limits (uvicorn.Config(http=...) takes a class)."""

    class Guarded(GuardedH11Protocol):
        pass

    Guarded.timeouts = {HEAD: header_timeout_s, BODY: body_timeout_s}
    Guarded.max_connections = max_connections
    Guarded.on_close = staticmethod(on_close)
    return Guarded


class GuardedH11Protocol(H11Protocol):
    timeouts: dict[str, float] = {HEAD: 10.0, BODY: 30.0}  # noqa: RUF012 (set per class by guarded_protocol)
    max_connections = 512
    on_close: Callable[[str], None] = staticmethod(lambda reason: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections:
            log.info(
                "refusing a connection from %s: %d open (limit %d)",
                self._peer(),
                len(self.connections) - 1,
                self.max_connections,
            )
            self._close(503, "too_many_connections", f"more than {self.max_connections} connections open; retry")
            self.on_close("too_many_connections")
            return
        self._follow_state()

    def data_received(self, data: bytes) -> None:
        if isinstance(self.transport, _LingeringTransport) and self.transport.lingering:
            return  # the rest of a body already answered: discarded
        super().data_received(data)
        self._follow_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_state(self) -> None:
        """Arm the deadline of the phase h11 is in; keep it running while the phase lasts."""
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        phase = HEAD if state is h11.IDLE else BODY if state is h11.SEND_BODY else None
        if phase == self._phase:
            return
        self._disarm()
        self._phase = phase
        if phase is not None:
            self._deadline = self.loop.call_later(self.timeouts[phase], self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        what = "request line and headers" if phase == HEAD else "request body"
        log.info(
            "closing the connection from %s: %s not received within %.1f s", self._peer(), what, self.timeouts[phase]
        )
        self.on_close(f"{phase}_timeout")
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                self.transport.close()
                return
            cycle.scope[TIMED_OUT] = phase  # type: ignore[literal-required]  # so the app counts a 408
            cycle.disconnected = True  # as connection_lost would: the app's answer is dropped, its receive ends
            cycle.message_event.set()
        self._close(408, "request_timeout", f"{what} not received within {self.timeouts[phase]:g} s")

    def _close(self, status: int, error: str, detail: str) -> None:
        """Answer outside h11's state machine (no request may have been parsed), then close."""
        body = json.dumps({"error": error, "detail": detail}).encode()
        reason = {408: b"Request Timeout", 503: b"Service Unavailable"}[status]
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body))
        )
        self.transport.write(head + body)
        self.transport.close()

    @property
    def body_pending(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"


class _LingeringTransport:
    """The connection's transport, closed gently when the client is still sending a body we answered
    early (401, 408, 413, 429): closing a socket with unread data makes the kernel reset it and drop
    the answer not yet sent, so the client would never see why. Instead: send the answer, shut down
    our side, read and discard what still comes for LINGER_S, then close (as nginx's lingering_close)."""

    def __init__(self, transport: asyncio.BaseTransport, protocol: GuardedH11Protocol) -> None:
        self._transport: Any = transport
        self._protocol = protocol
        self.lingering = False

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        if not self._protocol.body_pending or not self._transport.can_write_eof():
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()  # after the queued answer
        self._transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, self._transport.close)

    def is_closing(self) -> bool:
        return self.lingering or bool(self._transport.is_closing())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
