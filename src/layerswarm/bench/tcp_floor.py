"""The physical floor of a hop: the same bytes echoed over a raw TCP socket on loopback."""

from __future__ import annotations

import multiprocessing
import socket
import struct
import time


def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < n:
        chunk = sock.recv_into(view[got:n])
        if not chunk:
            raise ConnectionError("peer closed")
        got += chunk


def _serve(server: socket.socket) -> None:
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(64 * 1024 * 1024)
    header = bytearray(8)
    with conn:
        while True:
            try:
                _recv_exact(conn, 8, header)
            except ConnectionError:
                return
            (n,) = struct.unpack("!Q", header)
            _recv_exact(conn, n, buf)
            conn.sendall(header)
            conn.sendall(memoryview(buf)[:n])  # no copy: the floor must be the wire, not memcpy


def _echo_process(conn: object) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])  # type: ignore[attr-defined]
    _serve(server)


class EchoServer:
    """An echo server in another process (as a node is), and a client connection to it."""

    def __enter__(self) -> EchoServer:
        ctx = multiprocessing.get_context("spawn")  # fork would copy gRPC's threads' state
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_echo_process, args=(child,), daemon=True)
        self._proc.start()
        self._sock = socket.create_connection(("127.0.0.1", parent.recv()))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reply = bytearray(64 * 1024 * 1024 + 8)
        return self

    def round_trip(self, payload_bytes: int) -> float:
        """Seconds to send `payload_bytes` (length-prefixed) and receive them back."""
        payload = struct.pack("!Q", payload_bytes) + bytes(payload_bytes)
        started = time.perf_counter()
        self._sock.sendall(payload)
        _recv_exact(self._sock, payload_bytes + 8, self._reply)
        return time.perf_counter() - started

    def __exit__(self, *exc: object) -> None:
        self._sock.close()
        self._proc.terminate()
        self._proc.join(5)
