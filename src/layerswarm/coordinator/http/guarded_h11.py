"""uvicorn's h11 protocol with deadlines for each side of an exchange, strict framing, and a cap on
open connections.

uvicorn has no request-receipt timeout: `timeout_keep_alive` is armed only after a response and is
cancelled by any byte received, and an ASGI middleware runs only once the headers are parsed. So a
client that connects and sends nothing, or trickles a header byte a second (slow loris), holds its
connection and file descriptor for ever; 1,000 of them exhausted the coordinator's descriptors.
This protocol arms one deadline per phase of the client's side of the exchange, from h11's state:

- waiting for the request line and headers (a new connection, or the next request on a kept-alive
  one): `header_timeout_s`, not reset by trickled bytes;
- receiving the body: `body_timeout_s` for the whole body;
- the client reading our response: once its socket stops taking bytes (asyncio pauses writing), the
  response must be delivered within `write_timeout_s`, or the connection is dropped. Before, 520
  clients that asked for a response and never read it held every connection slot, and 200 others
  got 503s or resets.

On a receive deadline it answers 408 (JSON) when no response has started, and closes the connection.
Time spent computing an answer is never limited. The request head is checked before h11 sees it:

- past `max_header_bytes` (request line and headers, counted across reads, whatever their size) it
  is answered 431 and the connection closed; before, 100 KB of headers sent in one write passed;
- a request with both Content-Length and Transfer-Encoding is answered 400 and the connection
  closed, nothing of it processed (RFC 9112 6.1: such a message is how a request is smuggled past a
  proxy that reads the other header; h11 used the chunked framing and answered the request hidden
  after it, on a connection kept open).

Past `max_connections` open connections, a new one first takes the place of one that holds a slot
without using it (a response its client stopped reading, oldest first; else an idle kept-alive
connection), and only when there is none is answered 503 and closed, so descriptors stay free for
the gRPC connections to the nodes and clients that read get served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

HEAD, BODY, WRITE = "header", "body", "write"
HEAD_END = b"\r\n\r\n"
AMBIGUOUS = (b"content-length", b"transfer-encoding")  # both in one request: refused (RFC 9112 6.1)
# The kernel's send buffer per connection (it doubles it). Autotuned, it grows to 4 MB on loopback: a
# client that never reads then pins that much kernel memory, and our writes stall (which starts the
# write deadline and lets the connection be evicted) only once it is full. Our answers are small JSON.
SEND_BUFFER_BYTES = 256 * 1024
LINGER_S = 2.0  # after an early answer, how long the rest of a body is read and discarded
TIMED_OUT = "layerswarm.timed_out"  # scope key: set when this protocol answered 408 for a request the app holds


def guarded_protocol(
    header_timeout_s: float,
    body_timeout_s: float,
    max_connections: int,
    on_close: Callable[[str], None],
    write_timeout_s: float = 10.0,
    max_header_bytes: int = 16384,
) -> type[H11Protocol]:
    """An H11Protocol class with these limits (uvicorn.Config(http=...) takes a class)."""

    class Guarded(GuardedH11Protocol):
        pass

    Guarded.timeouts = {HEAD: header_timeout_s, BODY: body_timeout_s, WRITE: write_timeout_s}
    Guarded.max_connections = max_connections
    Guarded.max_header_bytes = max_header_bytes
    Guarded.on_close = staticmethod(on_close)
    return Guarded


class GuardedH11Protocol(H11Protocol):
    timeouts: dict[str, float] = {HEAD: 10.0, BODY: 30.0, WRITE: 10.0}  # noqa: RUF012 (set by guarded_protocol)
    max_connections = 512
    max_header_bytes = 16384
    on_close: Callable[[str], None] = staticmethod(lambda reason: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._head = bytearray()  # the request head received so far (phase HEAD), to check before h11 parses it
        self._stalled_since: float | None = None  # when the client stopped reading our response
        self._write_deadline: asyncio.TimerHandle | None = None
        self.refusing_head = False  # answered from its head, whose rest (and body) may still be coming
        self.conn.next_event = _strict_next_event(self.conn, self.max_header_bytes)  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections and not self._make_room():
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
        if self._phase == HEAD and not self._head_acceptable(data):
            return
        super().data_received(data)
        self._follow_state()

    # --- the request head, before h11 parses it ----------------------------------------------------

    def _head_acceptable(self, data: bytes) -> bool:
        """Count the head's bytes across reads and look at its header names once it is complete: False
        (and the connection answered and closed) for a head past max_header_bytes, or one framed twice."""
        start = max(0, len(self._head) - len(HEAD_END) + 1)
        self._head += data
        end = self._head.find(HEAD_END, start)
        size = len(self._head) if end < 0 else end + len(HEAD_END)
        if size > self.max_header_bytes:
            log.info("refusing a request from %s: its head passed %d bytes", self._peer(), self.max_header_bytes)
            self.on_close("header_too_large")
            self.refusing_head = True
            self._close(431, "header_too_large", f"request line and headers over {self.max_header_bytes} bytes")
            return False
        if end < 0:
            return True
        names = {line.split(b":", 1)[0].strip().lower() for line in bytes(self._head[:end]).split(b"\r\n")[1:]}
        self._head.clear()
        if all(name in names for name in AMBIGUOUS):
            log.info("refusing a request from %s: Content-Length and Transfer-Encoding both given", self._peer())
            self.on_close("ambiguous_framing")
            self.refusing_head = True
            self._close(400, "ambiguous_framing", "Content-Length and Transfer-Encoding together (RFC 9112 6.1)")
            return False
        return True

    # --- the client reading our response ------------------------------------------------------------

    def pause_writing(self) -> None:
        """The client's socket takes no more bytes: it must take some again (asyncio resumes writing once
        our buffer has drained below its low-water mark) within the write deadline, or the connection is
        dropped. Responses to requests it pipelined wait behind the stall as well."""
        super().pause_writing()
        self._stalled_since = self.loop.time()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.timeouts[WRITE], self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stalled_since = None
        self._cancel_write_deadline()

    def _cancel_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_expired(self) -> None:
        self._write_deadline = None
        if self.transport.is_closing() or self._stalled_since is None:
            return
        log.info("dropping the connection from %s: response not read within %.1f s", self._peer(), self.timeouts[WRITE])
        self.on_close("write_timeout")
        self._drop()

    def _drop(self) -> None:
        """Abort the connection: what is still buffered for it goes, and the app's wait to write ends."""
        transport = self.transport
        inner = transport._transport if isinstance(transport, _LingeringTransport) else transport
        inner.abort()

    def _make_room(self) -> bool:
        """Past the cap: drop the connection that holds its slot longest without using it (a response
        its client stopped reading, then an idle kept-alive one with nothing received). False: none."""
        others = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)]
        stalled = [c for c in others if c._stalled_since is not None and not c.transport.is_closing()]
        idle = [c for c in others if c._idle and not c.transport.is_closing()]
        if stalled:
            victim, why = min(stalled, key=lambda c: c._stalled_since or 0.0), "stalled_reader_evicted"
        elif idle:
            victim, why = idle[0], "idle_evicted"
        else:
            return False
        log.info("dropping the connection from %s to make room (%s)", victim._peer(), why)
        victim.on_close(why)
        victim._drop()
        return True

    @property
    def _idle(self) -> bool:
        """Kept alive between requests, with nothing of the next one received."""
        return self._phase == HEAD and not self._head and self.cycle is not None and self.cycle.response_complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._cancel_write_deadline()
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
        self._head.clear()  # a new phase: a new head is counted from its first byte
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
        reason = {
            400: b"Bad Request",
            408: b"Request Timeout",
            431: b"Request Header Fields Too Large",
            503: b"Service Unavailable",
        }[status]
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


def _strict_next_event(conn: h11.Connection, max_header_bytes: int) -> Callable[[], Any]:
    """h11's next_event, refusing what the raw check in data_received cannot see: a request h11 had
    already buffered (pipelined behind another) framed twice or with an oversized head. uvicorn answers
    RemoteProtocolError with 400 and closes the connection."""
    parse = conn.next_event

    def next_event() -> Any:
        event = parse()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if all(name in names for name in AMBIGUOUS):
                raise h11.RemoteProtocolError("Content-Length and Transfer-Encoding together", error_status_hint=400)
            size = len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
            if size > max_header_bytes:
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event

    return next_event


class _LingeringTransport:
    """The connection's transport, closed gently when the client is still sending a body we answered
    early (400, 401, 408, 413, 429, 431): closing a socket with unread data makes the kernel reset it and drop
    the answer not yet sent, so the client would never see why. Instead: send the answer, shut down
    our side, read and discard what still comes for LINGER_S, then close (as nginx's lingering_close)."""

    def __init__(self, transport: asyncio.BaseTransport, protocol: GuardedH11Protocol) -> None:
        self._transport: Any = transport
        self._protocol = protocol
        self.lingering = False

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        receiving = self._protocol.body_pending or self._protocol.refusing_head
        if not receiving or not self._transport.can_write_eof():
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
