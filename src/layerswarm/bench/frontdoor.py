"""The HTTP front door under attack: `python -m layerswarm.bench.frontdoor [--json FILE] [--quick]`.

One coordinator (default limits but a 2 s header timeout) in front of the shipped family's nodes on
127.0.0.1. A legit client sends small PNGs one at a time; its p50 is measured alone, then while
attackers run, interleaved phase by phase, so each figure is a ratio against the same run's baseline:

- pixel bombs: 2 clients sending, back to back, a PNG at the pixel budget (1 x 4,194,304, resize=true:
  the costliest image admitted) and one over it (1 x 16,777,216: refused from its header);
- held bodies: 100 connections that send 4 MB minus one byte of a JSON body and stall (coordinator RSS);
- slow loris: 1,000 connections trickling header bytes (coordinator open files, legit requests answered);
- smuggling: requests framed by both Content-Length and Transfer-Encoding, each hiding a second request
  (how many hidden requests were answered, and whether the connection stayed open);
- oversized headers: a 100 KB header block in one line and in 1,000 lines, in one write and in 50;
- slow readers: 520 connections (past the 512 slots) that ask for a large response and never read it,
  then 200 classifications, each on a new connection (how many were answered 200, their p50).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import socket
import statistics
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from layerswarm.bench import emit_report
from layerswarm.harness.procs import Proc, coordinator_cmd, spawn, stop_all
from layerswarm.models.zoo import family_root, robust_members

from .fixtures import nodes
from .machine import environment
from .shipped import layout


def png_bomb(width: int, height: int) -> bytes:
    """A valid all-black RGB PNG: small on the wire, width x height pixels once decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = (b"\x00" * (1 + 3 * width)) * height
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def small_png(size: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (120, 30, 200)).save(buf, format="PNG")
    return buf.getvalue()


def legit_p50(url: str, image: bytes, requests: int) -> dict[str, Any]:
    latencies, statuses = [], []
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(requests):
            started = time.perf_counter()
            reply = client.post("/v1/classify", files={"file": ("a.png", image, "image/png")})
            latencies.append((time.perf_counter() - started) * 1e3)
            statuses.append(reply.status_code)
            health = client.get("/healthz")
            statuses.append(health.status_code)
    return {"p50_ms": round(statistics.median(latencies), 2), "non_200": sum(s != 200 for s in statuses)}


@contextmanager
def attackers(count: int, attack: Callable[[threading.Event], None]) -> Iterator[None]:
    stop = threading.Event()
    threads = [threading.Thread(target=attack, args=(stop,), daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def bomb_loop(url: str, bomb: bytes, statuses: list[int]) -> Callable[[threading.Event], None]:
    def attack(stop: threading.Event) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                files = {"file": ("b.png", bomb, "image/png")}
                statuses.append(client.post("/v1/classify", files=files, data={"resize": "true"}).status_code)

    return attack


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def held_bodies(url: str, proc: Proc, count: int, size: int) -> dict[str, Any]:
    """`count` clients each send all but the last byte of a `size`-byte JSON body, at once, and stall."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/classify HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\ncontent-length: {size}\r\n\r\n"
    ).encode()
    body = b'{"image_base64": "' + b"A" * (size - 20)  # short of the declared length: never complete
    before = rss_mib(proc.pid)
    socks: list[socket.socket] = []
    answers: list[bytes] = []

    def hold() -> None:
        sock = socket.create_connection((host, int(port)), timeout=5)
        socks.append(sock)
        with suppress(TimeoutError, ConnectionError):  # refused and closed, or no longer read
            sock.sendall(head + body)
        try:
            sock.settimeout(0.5)
            answers.append(sock.recv(64)[:12])
        except (TimeoutError, ConnectionError):
            answers.append(b"(held)")

    threads = [threading.Thread(target=hold) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    during = rss_mib(proc.pid)
    for sock in socks:
        sock.close()
    return {
        "connections": count,
        "body_bytes": size,
        "rss_before_mib": before,
        "rss_while_held_mib": during,
        "answers": {a.decode(errors="replace"): answers.count(a) for a in set(answers)},
    }


def slow_loris(url: str, proc: Proc, count: int, image: bytes) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: a\r\nx-slow: ")
            socks.append(sock)
        except OSError:
            break
    peak_files = open_files(proc.pid)
    served = legit_p50(url, image, 5)
    time.sleep(3.0)  # past the 2 s header timeout
    closed = 0
    for sock in socks:
        sock.settimeout(0.1)
        with suppress(TimeoutError, ConnectionError):
            closed += sock.recv(65536).startswith(b"HTTP/1.1 ") or 0
        sock.close()
    return {
        "connections": len(socks),
        "coordinator_open_files_peak": peak_files,
        "closed_by_server_after_timeout": closed,
        "legit_non_200_during": served["non_200"],
    }


def _exchange(url: str, raw: bytes, writes: int = 1, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send `raw` in `writes` pieces and read until the server closes (True) or goes quiet (False)."""
    host, port = url.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        step = -(-len(raw) // writes)
        with suppress(ConnectionError):
            for i in range(0, len(raw), step):
                sock.sendall(raw[i : i + step])
        try:
            while more := sock.recv(65536):
                answer += more
            return answer, True
        except TimeoutError:
            return answer, False
        except ConnectionError:
            return answer, True


def smuggling(url: str) -> dict[str, Any]:
    """Each variant hides GET /v1/nodes behind a body that Content-Length and chunked framing delimit
    differently; a hidden request answered is one smuggled past a proxy that reads the other header."""
    hidden = b"GET /v1/nodes HTTP/1.1\r\nhost: a\r\n\r\n"
    post = b"POST /v1/classify HTTP/1.1\r\nhost: a\r\n"
    variants = {
        "length then chunked": b"content-length: 41\r\ntransfer-encoding: chunked\r\n",
        "chunked then length": b"transfer-encoding: chunked\r\ncontent-length: 41\r\n",
        "upper-case chunked": b"Content-Length: 41\r\nTransfer-Encoding: CHUNKED\r\n",
        "length zero": b"content-length: 0\r\ntransfer-encoding: chunked\r\n",
        "chunked, space before colon": b"content-length: 41\r\ntransfer-encoding : chunked\r\n",
        "two lengths": b"content-length: 5\r\ncontent-length: 41\r\n",
        "behind a pipelined request": b"content-length: 41\r\ntransfer-encoding: chunked\r\n",
    }
    out: dict[str, Any] = {}
    for name, head in variants.items():
        raw = post + head + b"\r\n0\r\n\r\n" + hidden
        if name == "behind a pipelined request":
            raw = b"GET /healthz HTTP/1.1\r\nhost: a\r\n\r\n" + raw
        answer, closed = _exchange(url, raw)
        statuses = [int(code) for code in re.findall(rb"HTTP/1.1 (\d{3}) ", answer)]
        out[name] = {"statuses": statuses, "hidden_answered": b"reachable_depth" in answer, "closed": closed}
    out["hidden_requests_answered"] = sum(v["hidden_answered"] for v in out.values())
    return out


def oversized_headers(url: str) -> dict[str, Any]:
    lines = {
        "one line": b"x-big: " + b"a" * 100_000 + b"\r\n",
        "1000 lines": b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 90) for i in range(1000)),
    }
    out = {}
    for name, head in lines.items():
        for writes in (1, 50):
            answer, closed = _exchange(url, b"GET /healthz HTTP/1.1\r\nhost: a\r\n" + head + b"\r\n", writes)
            status = re.match(rb"HTTP/1.1 (\d{3}) ", answer)
            out[f"{name}, {writes} write{'s' if writes > 1 else ''}"] = {
                "status": int(status.group(1)) if status else None,
                "closed": closed,
            }
    return out


LARGE = b"GET /static-offline-docs/swagger-ui-bundle.js HTTP/1.1\r\nhost: a\r\n\r\n"  # 1.5 MB, no key needed


def slow_readers(url: str, proc: Proc, count: int, image: bytes, requests: int) -> dict[str, Any]:
    """`count` clients ask for a large response three times over with a 4 KiB receive window and never
    read; then `requests` classifications, each on a new connection, while they stay."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(10)
        try:
            sock.connect((host, int(port)))
            sock.sendall(LARGE * 3)
        except OSError:
            sock.close()
            continue
        socks.append(sock)
    time.sleep(2.0)  # their writes stall
    statuses: dict[str, int] = {}
    latencies = []
    for _ in range(requests):
        started = time.perf_counter()
        try:
            with httpx.Client(base_url=url, timeout=60) as client:  # a new connection: it needs a slot
                status = str(client.post("/v1/classify", files={"file": ("a.png", image, "image/png")}).status_code)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        latencies.append((time.perf_counter() - started) * 1e3)
        statuses[status] = statuses.get(status, 0) + 1
    peak_files = open_files(proc.pid)
    for sock in socks:
        sock.close()
    return {
        "slow_readers": count,
        "connected": len(socks),
        "requests": requests,
        "statuses": statuses,
        "answered_200": statuses.get("200", 0),
        "p50_ms": round(statistics.median(latencies), 2),
        "coordinator_open_files_peak": peak_files,
    }


def run(quick: bool) -> dict[str, Any]:
    members = robust_members(family_root())[:1]
    image = small_png(32)
    requests = 15 if quick else 40
    report: dict[str, Any] = {"environment": environment(), "legit_requests_per_phase": requests}
    with nodes(layout(members)) as procs:
        coord = spawn("bench-coordinator", coordinator_cmd(members[0], procs, "--header-timeout", "2"))
        url = f"http://127.0.0.1:{coord.ready['port']}"
        try:
            legit_p50(url, image, 5)  # warm-up
            phases: dict[str, Any] = {"baseline": legit_p50(url, image, requests)}
            for name, bomb in (
                ("bomb_at_budget", png_bomb(1, 4096 * 1024)),
                ("bomb_over_budget", png_bomb(1, 1 << 24)),
            ):
                statuses: list[int] = []
                with attackers(2, bomb_loop(url, bomb, statuses)):
                    time.sleep(0.5)
                    phases[name] = legit_p50(url, image, requests)
                phases[name]["bomb_statuses"] = sorted(set(statuses))
                phases[name]["bombs_sent"] = len(statuses)
                phases[name]["p50_ratio_to_baseline"] = round(phases[name]["p50_ms"] / phases["baseline"]["p50_ms"], 2)
            phases["baseline_after"] = legit_p50(url, image, requests)
            report["pixel_bombs"] = phases
            report["held_bodies"] = held_bodies(url, coord, 100, 4 * 1024 * 1024)
            report["slow_loris"] = slow_loris(url, coord, 1000, image)
            report["smuggling"] = smuggling(url)
            report["oversized_headers"] = oversized_headers(url)
            report["slow_readers"] = slow_readers(url, coord, 520, image, 50 if quick else 200)
            report["slow_readers"]["p50_ratio_to_baseline"] = round(
                report["slow_readers"]["p50_ms"] / report["pixel_bombs"]["baseline"]["p50_ms"], 2
            )
            report["after_attacks"] = legit_p50(url, image, 5)
        finally:
            stop_all([coord])
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    return emit_report(run(args.quick), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
