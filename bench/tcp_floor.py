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
            conn.sendall(bytes(header) + bytes(buf[:n]))


def _echo_process(conn: object) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])  # type: ignore[attr-defined]
    _serve(server)


def echo_round_trips(payload_bytes: int, reps: int) -> list[float]:
    """Seconds per round trip of `payload_bytes` there and back (length-prefixed) to an echo server in
    another process (as a node is), after one warm-up."""
    ctx = multiprocessing.get_context("spawn")  # fork would copy gRPC's threads' state
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_process, args=(child,), daemon=True)
    proc.start()
    port = parent.recv()
    payload = struct.pack("!Q", payload_bytes) + bytes(payload_bytes)
    reply = bytearray(payload_bytes + 8)
    samples = []
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(reps + 1):
                started = time.perf_counter()
                sock.sendall(payload)
                _recv_exact(sock, payload_bytes + 8, reply)
                if i:
                    samples.append(time.perf_counter() - started)
    finally:
        proc.terminate()
        proc.join(5)
    return samples
