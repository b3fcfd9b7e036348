"""The HTTP front door under attack: `python -m layerswarm.bench.frontdoor [--json FILE] [--quick]`.

One coordinator (default limits but a 2 s header timeout) in front of the shipped family's nodes on
127.0.0.1. A legit client sends small PNGs one at a time; its p50 is measured alone, then while
attackers run, interleaved phase by phase, so each figure is a ratio against the same run's baseline:

- pixel bombs: 2 clients sending, back to back, a PNG at the pixel budget (1 x 4,194,304, resize=true:
  the costliest image admitted) and one over it (1 x 16,777,216: refused from its header);
- held bodies: 100 connections that send 4 MB minus one byte of a JSON body and stall (coordinator RSS);
- slow loris: 1,000 connections trickling header bytes (coordinator open files, legit requests answered).
"""

from __future__ import annotations

import argparse
import io
import os
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
