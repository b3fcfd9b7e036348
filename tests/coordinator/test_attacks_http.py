"""Attacks on the coordinator's HTTP front door, against a real coordinator process on 127.0.0.1.

Each test runs one attack, bounded in connections, bytes and time, and checks the defence that stops
it: the pixel budget and decoding off the event loop, streamed size limits (nothing spooled to disk),
admission before bodies, header and body deadlines, the connection cap, strict JSON, quiet disconnects,
every status in the metrics, and API keys. Legit requests are checked to be answered, never timed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import re
import select
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from layerswarm.harness.procs import Proc, coordinator_cmd, spawn, stop_all

from ..swarm import start_nodes

pytestmark = pytest.mark.slow

UPLOAD_LIMIT = 2_000_000  # over the 1 MB at which Starlette would spool a file part to disk
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 3.0
MAX_IN_FLIGHT = 4
MAX_CONNECTIONS = 260
WRITE_TIMEOUT_S = 2.0
BUDGET = 4096 * 1024  # the default pixel budget
KEYS = ("first-key-0123456789", "second-key-0123456789")


def png(size: tuple[int, int] = (16, 16), seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def png_bomb(width: int, height: int) -> bytes:
    """A real, valid, all-black RGB PNG of width x height: tiny on the wire, huge once decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = (b"\x00" * (1 + 3 * width)) * height
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)),
            chunk(b"IDAT", zlib.compress(rows, 6)),
            chunk(b"IEND", b""),
        ]
    )


@pytest.fixture(scope="module")
def nodes(family_dirs: list[Path]) -> Iterator[list[Proc]]:
    procs = start_nodes([(family_dirs[0], b) for b in range(3)])
    yield procs
    stop_all(procs)


@pytest.fixture(scope="module")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("coordinator-tmp")


@pytest.fixture(scope="module")
def coord(family_dirs: list[Path], nodes: list[Proc], spool: Path) -> Iterator[Proc]:
    cmd = coordinator_cmd(
        family_dirs[0],
        nodes,
        *("--max-upload-bytes", str(UPLOAD_LIMIT), "--max-concurrent-requests", str(MAX_IN_FLIGHT)),
        *("--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S)),
        *("--max-connections", str(MAX_CONNECTIONS), "--write-timeout", str(WRITE_TIMEOUT_S)),
    )
    # INFO: disconnects and closed connections are logged there; TMPDIR: where a spooled upload would land
    proc = spawn("coordinator", cmd, env={"LAYERSWARM_LOG": "INFO", "TMPDIR": str(spool)})
    yield proc
    stop_all([proc])


@pytest.fixture
def client(coord: Proc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=30) as c:
        yield c


def port(proc: Proc) -> int:
    return int(proc.ready["port"])


def classify_upload(client: httpx.Client, image: bytes, **fields: str) -> httpx.Response:
    return client.post("/v1/classify", files={"file": ("a.png", image, "image/png")}, data=fields)


def counter(client: httpx.Client, endpoint: str, status: int) -> float:
    pattern = rf'layerswarm_requests_total{{endpoint="{re.escape(endpoint)}",status="{status}"}} (\S+)'
    found = re.search(pattern, client.get("/metrics").text)
    return float(found.group(1)) if found else 0.0


def decoding_large(client: httpx.Client) -> float:
    found = re.search(r'layerswarm_http_decoding{lane="large"} (\S+)', client.get("/metrics").text)
    return float(found.group(1)) if found else 0.0


# --- decompression bombs ---------------------------------------------------------------------------


@pytest.mark.parametrize("resize", ["true", "false"])
def test_pixel_bomb_is_refused_from_its_header(client: httpx.Client, resize: str) -> None:
    bomb = png_bomb(1, 16_777_216)  # 1 x 16,777,216 pixels in about 65 KB
    assert len(bomb) < UPLOAD_LIMIT
    reply = classify_upload(client, bomb, resize=resize)
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"] == "too_many_pixels" and "budget" in reply.json()["detail"]
    assert client.get("/healthz").json() == {"status": "ok"}
    assert classify_upload(client, png()).status_code == 200


def test_header_claiming_billions_of_pixels_is_refused(client: httpx.Client) -> None:
    header_only = png_bomb(1, 1)[:16] + struct.pack(">II", 65535, 65535) + png_bomb(1, 1)[24:]
    reply = classify_upload(client, header_only, resize="true")
    assert reply.status_code in (400, 413), reply.text  # Pillow's own bomb check, or ours; never decoded
    assert reply.json()["error"] in ("too_many_pixels", "invalid_image")


def png_with_broken_chunk(size: int = 16) -> bytes:
    """A PNG whose header is fine and whose pixel data continues in a chunk with an impossible type:
    Pillow opens it, then raises SyntaxError ("broken PNG file") while decoding the pixels."""
    rows = (b"\x00" + bytes(range(3 * size))) * size
    data = zlib.compress(rows, 0)
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            png_chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)),
            png_chunk(b"IDAT", data[: len(data) // 2]),
            png_chunk(b"\x01\x02\x03\x04", data[len(data) // 2 :]),
            png_chunk(b"IEND", b""),
        ]
    )


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def tiff_with_float_strip_offset(size: int = 16) -> bytes:
    """A grey TIFF whose StripOffsets tag is a DOUBLE: Pillow opens it, then raises TypeError while
    decoding (it seeks to 0.5)."""
    entries = [(256, 3, size), (257, 3, size), (258, 3, 8), (259, 3, 1), (262, 3, 1)]  # SHORT values
    entries += [(273, 12, None), (277, 3, 1), (278, 3, size), (279, 4, size * size)]  # 12: DOUBLE, 4: LONG
    after_ifd = 8 + 2 + 12 * len(entries) + 4  # the DOUBLE's 8 bytes do not fit in the entry: they go here
    ifd = [struct.pack("<HHII", tag, kind, 1, after_ifd if value is None else value) for tag, kind, value in entries]
    head = b"II*\x00" + struct.pack("<IH", 8, len(entries))
    return head + b"".join(ifd) + struct.pack("<I", 0) + struct.pack("<d", 0.5) + bytes(size * size)


@pytest.mark.parametrize("image", [png_with_broken_chunk(), tiff_with_float_strip_offset()], ids=["png", "tiff"])
def test_corrupt_pixel_data_is_a_400_not_a_500(client: httpx.Client, image: bytes) -> None:
    """Pillow raises more than OSError and ValueError on corrupt pixel data (found by mutating valid
    images): each is the image's fault, a 400 naming the item, never a 500."""
    for resize in ("false", "true"):
        reply = classify_upload(client, image, resize=resize)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"] == "invalid_image" and "cannot decode" in reply.json()["detail"]
    files = [("file", ("a.png", png(), "image/png")), ("file", ("b.png", image, "image/png"))]
    reply = client.post("/v1/classify/batch", files=files)
    assert reply.status_code == 400, reply.text
    assert reply.json()["detail"].startswith("item 1: cannot decode")
    assert classify_upload(client, png()).status_code == 200


def test_decoding_runs_off_the_event_loop(client: httpx.Client, coord: Proc) -> None:
    """Images within the budget but slow to decode: while they decode, the server still answers
    (a scrape shows a decode in progress, which a decode on the event loop could never let happen),
    and probes and ordinary requests are answered."""
    bomb = png_bomb(1, BUDGET)  # at the budget: accepted, about a second to decode and resize
    results: list[int] = []

    def attacker() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port(coord)}", timeout=60) as c:
            results.append(classify_upload(c, bomb, resize="true").status_code)

    threads = [threading.Thread(target=attacker) for _ in range(2)]
    for t in threads:
        t.start()
    seen_decoding = False
    while any(t.is_alive() for t in threads):
        seen_decoding |= decoding_large(client) >= 1
        assert client.get("/healthz").status_code == 200
    for t in threads:
        t.join()
    assert results == [200, 200]
    assert seen_decoding, "no answer was given while an image was being decoded"
    assert classify_upload(client, png()).status_code == 200


# --- oversized and held bodies ---------------------------------------------------------------------


def _open_fds_under(pid: int, folder: Path) -> list[str]:
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return [link for link in links if link.startswith(str(folder))]


def kserve_infer(family_dirs: list[Path]) -> str:
    return f"/v2/models/{family_dirs[0].name}/infer"


@pytest.mark.parametrize("path", ["/v1/classify", "/v1/classify/batch"])
def test_chunked_oversize_upload_is_refused_while_streaming(coord: Proc, spool: Path, path: str) -> None:
    """A chunked multipart upload with no Content-Length: 413 once past the limit, long before the
    64 MB the client offers, and no byte of it in a temporary file (the client pauses past 1 MB, where
    Starlette would have spooled the part to disk, and looks at the server's open files)."""
    boundary = "x" * 16
    head = (
        f"POST {path} HTTP/1.1\r\nhost: a\r\ncontent-type: multipart/form-data; boundary={boundary}\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()
    part = f'--{boundary}\r\ncontent-disposition: form-data; name="file"; filename="a.png"\r\n\r\n'.encode()
    piece = os.urandom(64 * 1024)
    offered, sent, spooled, answer = 64 * 1024 * 1024, 0, [], b""
    with socket.create_connection(("127.0.0.1", port(coord)), timeout=5) as sock:
        sock.sendall(head + b"%x\r\n%s\r\n" % (len(part), part))
        while sent < offered and not answer:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break  # refused and closed, or no longer read
            sent += len(piece)
            if sent == 24 * len(piece):  # 1.5 MB: over the spool threshold, under the limit
                for _ in range(25):
                    spooled += _open_fds_under(coord.pid, spool)
                    time.sleep(0.02)
            if select.select([sock], [], [], 0)[0]:  # answered already?
                answer = sock.recv(65536)
        with contextlib.suppress(ConnectionResetError):  # the server may reset: unread upload bytes
            answer += _read_until_closed(sock, 10)
    assert not spooled and not list(spool.iterdir()), spooled
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"too_large"' in answer
    assert sent < offered // 4, f"the server read {sent} bytes before refusing"


@pytest.mark.parametrize("path", ["/v1/classify", "/v1/classify/batch", "kserve"])
def test_held_bodies_do_not_delay_the_429(
    coord: Proc, client: httpx.Client, family_dirs: list[Path], path: str
) -> None:
    """MAX_IN_FLIGHT clients send headers and a sliver of a body, then stall. The next request is
    refused with 429 at once, from its headers (its body is never sent); the stalled ones are closed
    with 408 after the body timeout, and then requests are served again. Every endpoint that reads
    a body is admitted the same way."""
    path = kserve_infer(family_dirs) if path == "kserve" else path
    endpoint = "/v2/models/{model}/infer" if path.startswith("/v2") else path
    head = (
        f"POST {path} HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\ncontent-length: {UPLOAD_LIMIT}\r\n\r\n"
    ).encode()
    held = [socket.create_connection(("127.0.0.1", port(coord)), timeout=10) for _ in range(MAX_IN_FLIGHT)]
    try:
        for sock in held:
            sock.sendall(head + b'{"image_base64": "')
        deadline = time.monotonic() + 10
        while client.get("/metrics").text.count("layerswarm_http_in_flight 4.0") == 0:
            assert time.monotonic() < deadline, "the held requests were never admitted"
        with socket.create_connection(("127.0.0.1", port(coord)), timeout=10) as late:
            late.sendall(head)  # headers only: a 429 must not wait for the body
            answer = _read_until_closed(late, 10)
        assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
        assert b'"error"' in answer and b"connection: close" in answer.lower()
        assert b"busy" in answer or path.startswith("/v2")  # KServe: {"error": message}, no code
        timeouts = counter(client, endpoint, 408)
        for sock in held:  # closed by the server after the body timeout
            reply = _read_until_closed(sock, 10)
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        deadline = time.monotonic() + 5  # the app sees each closed request end, and counts it as a 408
        while counter(client, endpoint, 408) < timeouts + MAX_IN_FLIGHT:
            assert time.monotonic() < deadline, "held requests not counted as 408"
    finally:
        for sock in held:
            sock.close()
    assert classify_upload(client, png()).status_code == 200


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        more = sock.recv(65536)
        if not more:
            return data
        data += more


# --- slow loris and connection floods --------------------------------------------------------------


async def _slow_loris(port_: int, count: int, trickle_s: float) -> list[bytes]:
    """`count` connections that send a request line, then a header byte every `trickle_s` seconds,
    until the server closes them; returns what each received."""
    conns = [await asyncio.open_connection("127.0.0.1", port_) for _ in range(count)]
    for _, writer in conns:
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: a\r\nx-slow: ")
    answers: list[bytes] = [b""] * count

    async def trickle(i: int) -> None:
        reader, writer = conns[i]
        while not reader.at_eof():
            try:
                writer.write(b"a")
                await writer.drain()
                answers[i] += await asyncio.wait_for(reader.read(65536), trickle_s)
            except asyncio.TimeoutError:
                continue
            except ConnectionError:
                break
        writer.close()

    await asyncio.wait_for(asyncio.gather(*(trickle(i) for i in range(count))), HEADER_TIMEOUT_S + 15)
    return answers


def closed_connections(client: httpx.Client, reason: str) -> float:
    found = re.search(
        rf'layerswarm_http_connections_closed_total{{reason="{reason}"}} (\S+)', client.get("/metrics").text
    )
    return float(found.group(1)) if found else 0.0


def test_slow_loris_connections_are_closed_and_others_served(coord: Proc, client: httpx.Client) -> None:
    before = closed_connections(client, "header_timeout")
    results: dict[str, list[bytes]] = {}
    attack = threading.Thread(target=lambda: results.update(answers=asyncio.run(_slow_loris(port(coord), 200, 0.2))))
    attack.start()
    try:
        while attack.is_alive():  # the others are served throughout
            assert client.get("/healthz").status_code == 200
            assert classify_upload(client, png()).status_code == 200
    finally:
        attack.join(30)
    answers = results["answers"]  # every slow connection ended, within the bound above, answered 408
    assert len(answers) == 200 and all(a.startswith(b"HTTP/1.1 408") for a in answers), {a[:40] for a in answers}
    assert b'"request_timeout"' in answers[0]
    assert closed_connections(client, "header_timeout") >= before + 200


def test_connections_past_the_cap_are_refused_at_once(family_dirs: list[Path], nodes: list[Proc]) -> None:
    """Its own coordinator: a cap of 20 and a header timeout long enough that, however slowly this
    machine opens 30 connections, all are open at once."""
    cap, extra = 20, 10
    proc = spawn("coordinator-capped", coordinator_cmd(family_dirs[0], nodes, "--max-connections", str(cap)))
    try:
        socks = [socket.create_connection(("127.0.0.1", port(proc)), timeout=10) for _ in range(cap + extra)]
        try:
            refused = [_read_until_closed(sock, 5) for sock in socks[cap:]]  # answered at once, not after 10 s
            assert all(r.startswith(b"HTTP/1.1 503") and b"too_many_connections" in r for r in refused), refused
        finally:
            for sock in socks:
                sock.close()
        with httpx.Client(base_url=f"http://127.0.0.1:{port(proc)}", timeout=30) as c:
            assert c.get("/healthz").status_code == 200  # the held ones are gone: served again
    finally:
        stop_all([proc])


# --- framing, the head's size, clients that do not read ------------------------------------------------


def _hiding(head: bytes) -> bytes:
    """A POST framed by both Content-Length (41: the rest, to a proxy that reads it) and chunked (its end
    at 0\\r\\n\\r\\n, to h11), hiding GET /v1/nodes behind its body."""
    return (
        b"POST /v1/classify HTTP/1.1\r\nhost: a\r\n" + head + b"\r\n0\r\n\r\nGET /v1/nodes HTTP/1.1\r\nhost: a\r\n\r\n"
    )


SMUGGLED = {
    "length then chunked": _hiding(b"content-length: 41\r\ntransfer-encoding: chunked\r\n"),
    "chunked then length": _hiding(b"Transfer-Encoding: chunked\r\nContent-Length: 41\r\n"),
    "upper-case chunked": _hiding(b"Content-Length: 41\r\nTransfer-Encoding: CHUNKED\r\n"),
    "length zero": _hiding(b"Content-Length: 0\r\nTransfer-Encoding: chunked\r\n"),
    "behind a pipelined request": b"GET /healthz HTTP/1.1\r\nhost: a\r\n\r\n"
    + _hiding(b"content-length: 41\r\ntransfer-encoding: chunked\r\n"),
}


@pytest.mark.parametrize("raw", SMUGGLED.values(), ids=SMUGGLED.keys())
def test_a_request_framed_twice_is_refused_and_what_it_hides_never_answered(coord: Proc, raw: bytes) -> None:
    """RFC 9112 6.1: Content-Length with Transfer-Encoding is how a request is smuggled past a proxy that
    reads the other header. Before, h11 took the chunked framing, and the GET hidden after the body was
    answered on a connection kept open; now the request is answered 400 and the connection closed."""
    with socket.create_connection(("127.0.0.1", port(coord)), timeout=10) as sock:
        sock.sendall(raw)
        answer = _read_until_closed(sock, 10)  # closed by the server: a timeout here fails the test
    statuses = re.findall(rb"HTTP/1.1 (\d{3}) ", answer)
    assert statuses[-1] == b"400" and statuses.count(b"400") == 1, answer
    assert b"reachable_depth" not in answer  # /v1/nodes, the hidden request, never answered


@pytest.mark.parametrize(
    "head",
    [
        b"x-big: " + b"a" * 100_000 + b"\r\n",  # one line
        b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 90) for i in range(1000)),  # 1,000 lines
    ],
    ids=["one line", "1000 lines"],
)
@pytest.mark.parametrize("writes", [1, 50], ids=["one write", "50 writes"])
def test_an_oversized_header_block_is_431_whatever_the_read_size(coord: Proc, head: bytes, writes: int) -> None:
    """Before, 100 KB of headers sent in one write was accepted (h11 limits only an incomplete head)."""
    raw = b"GET /healthz HTTP/1.1\r\nhost: a\r\n" + head + b"\r\n"
    step = -(-len(raw) // writes)
    with socket.create_connection(("127.0.0.1", port(coord)), timeout=10) as sock:
        with contextlib.suppress(ConnectionError):  # refused before the last write: the rest goes nowhere
            for i in range(0, len(raw), step):
                sock.sendall(raw[i : i + step])
        answer = _read_until_closed(sock, 10)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"header_too_large" in answer, answer[:200]


LARGE = b"GET /static-offline-docs/swagger-ui-bundle.js HTTP/1.1\r\nhost: a\r\n\r\n"  # 1.5 MB, open path


def _slow_reader(port_: int) -> socket.socket:
    """A client that asks for a large response three times over and never reads: a tiny receive window,
    so our writes stall once the kernel's buffers (about 1.3 MB on loopback) are full."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port_))
    sock.sendall(LARGE * 3)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        while sock.recv(1 << 20):
            pass
        return True  # end of stream
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def test_a_client_that_does_not_read_is_dropped_after_the_write_timeout(coord: Proc, client: httpx.Client) -> None:
    before = closed_connections(client, "write_timeout")
    reader = _slow_reader(port(coord))
    try:
        time.sleep(WRITE_TIMEOUT_S * 3)  # stalled, then past the write deadline (with room for a busy machine)
        assert _closed_by_server(reader)  # before: held (with its admission and connection slot) for ever
    finally:
        reader.close()
    assert closed_connections(client, "write_timeout") >= before + 1


def test_slow_readers_past_the_cap_give_way_to_clients_that_read(coord: Proc, client: httpx.Client) -> None:
    """More non-reading clients than connection slots: a client that reads takes the place of one
    stalled longest. Before, the stalled ones held every slot and the others got 503 or resets."""
    readers = [_slow_reader(port(coord)) for _ in range(MAX_CONNECTIONS + 10)]
    try:
        time.sleep(WRITE_TIMEOUT_S / 2)  # their writes stall (well before their deadline)
        statuses = []
        for _ in range(20):
            with httpx.Client(base_url=f"http://127.0.0.1:{port(coord)}", timeout=30) as fresh:  # a slot each
                statuses.append(fresh.get("/v1/nodes").status_code)
        assert statuses == [200] * 20, statuses
    finally:
        for sock in readers:
            sock.close()


# --- malformed JSON ---------------------------------------------------------------------------------

IMAGE_B64 = base64.b64encode(png()).decode()
WITH_IMAGE = b'{"image_base64": "' + IMAGE_B64.encode() + b'"'  # an object left open for one more field


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[" * 100_000, "nested"),
        (b'{"a": ' * 30_000 + b"1" + b"}" * 30_000, "nested"),
        (WITH_IMAGE + b', "top_k": 1' + b"0" * 4300 + b"}", "digits"),
        (WITH_IMAGE + b', "seed": ' + b"9" * 4301 + b"}", "digits"),
        (WITH_IMAGE + b', "exit_confidence": NaN}', "NaN"),
        (b'{"image_base64": "\xff\xfe"}', "UTF-8"),
        (b"\xff\xfe\x00\x00", ""),
        (b'["image_base64"]', "JSON object"),
        (b"12", "JSON object"),
        (b'"just a string"', "JSON object"),
        (b"", "JSON"),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/classify", "/v1/classify/batch"])
def test_malformed_json_is_a_400_with_the_reason(client: httpx.Client, body: bytes, reason: str, endpoint: str) -> None:
    reply = client.post(endpoint, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == "invalid_json" and reason in reply.json()["detail"]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        (b'{"inputs": [{"name": "images", "shape": [' + b"9" * 4301 + b"]}]}", "digits"),
        (b'{"inputs": NaN}', "NaN"),
    ],
)
def test_kserve_infer_uses_the_strict_decoder(client: httpx.Client, body: bytes, reason: str) -> None:
    model = client.get("/v2/models").json()["models"][0]["name"]
    reply = client.post(f"/v2/models/{model}/infer", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reason in reply.json()["error"]


@pytest.mark.parametrize("label", ["\u00b2", "9" * 256, "no-such-class", "4"])
def test_a_label_that_names_no_class_is_refused_before_it_runs_never_a_500(client: httpx.Client, label: str) -> None:
    """A true label may be a class name or index: "²" is a digit to str.isdigit but int() refuses it, as it
    refuses 4,301 digits or more; either one answered 500 after the whole classification had run. Any
    label naming no class (4: the tiny model has classes 0-3) then counted as a wrong answer on the swarm
    page, silently (a typo). Now each API refuses it, with the classes, before anything runs."""
    reply = classify_upload(client, png(), label=label)
    assert reply.status_code == 422 and "neither a class of the model (a, b, c, d)" in reply.json()["detail"]
    model = client.get("/v2/models").json()["models"][0]["name"]
    encoded = {"name": "images_encoded", "datatype": "BYTES", "shape": [1], "data": [IMAGE_B64]}
    data = [base64.b64encode(label.encode()).decode()]
    body = {"inputs": [encoded, {"name": "label", "datatype": "BYTES", "shape": [1], "data": data}]}
    reply = client.post(f"/v2/models/{model}/infer", json=body)
    assert reply.status_code == 400 and "nor an index 0-3" in reply.json()["error"], reply.text
    for index_or_name in ("3", "a"):  # what a label may be
        assert classify_upload(client, png(), label=index_or_name).status_code == 200


def test_a_label_longer_than_any_class_name_is_refused_by_every_api(client: httpx.Client) -> None:
    """The JSON APIs held a true label to 256 characters; a batch form's `label` fields and KServe's
    `label` elements were bounded only by the body (megabytes a label, decoded and compared)."""
    long = "9" * 1000  # within a form field's 1 KiB
    assert classify_upload(client, png(), label=long).status_code == 422
    files = [("file", ("a.png", png(), "image/png")), ("file", ("b.png", png(), "image/png"))]
    reply = client.post("/v1/classify/batch", files=files, data={"label": ["cat", long]})
    assert reply.status_code == 422, reply.text
    assert "256" in reply.json()["detail"]
    model = client.get("/v2/models").json()["models"][0]["name"]
    encoded = {"name": "images_encoded", "datatype": "BYTES", "shape": [1], "data": [IMAGE_B64]}
    label = {"name": "label", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(long.encode() * 5).decode()]}
    reply = client.post(f"/v2/models/{model}/infer", json={"inputs": [encoded, label]})
    assert reply.status_code == 400, reply.text
    assert "256" in reply.json()["error"]


@pytest.mark.parametrize("value", ["9" * 5000, "\u00b2"])
def test_an_absurd_kserve_header_length_is_a_400(client: httpx.Client, value: str) -> None:
    model = client.get("/v2/models").json()["models"][0]["name"]
    headers = {"content-type": "application/json", "Inference-Header-Content-Length": value.encode("latin-1")}
    reply = client.post(f"/v2/models/{model}/infer", content=b"{}", headers=headers)
    assert reply.status_code == 400, reply.text
    assert "Inference-Header-Content-Length" in reply.json()["error"]


def test_a_kserve_shape_of_many_dimensions_is_refused_before_its_product(client: httpx.Client) -> None:
    """The product of a shape's dimensions costs time quadratic in its length: 40,000 dimensions of 19
    digits (an 800 KB body) held the event loop 5 s, every other request and health check waiting, and
    the body limit (16 MiB by default) allows 20 times as many. A shape is refused by its rank first."""
    model = client.get("/v2/models").json()["models"][0]["name"]
    dims = b",".join([b"9999999999999999999"] * 40_000)
    body = b'{"inputs": [{"name": "images", "datatype": "FP32", "shape": [' + dims + b'], "data": []}]}'
    started = time.monotonic()
    reply = client.post(f"/v2/models/{model}/infer", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert "dimensions" in reply.json()["error"] and len(reply.text) < 1000  # the shape is not echoed back
    assert time.monotonic() - started < 2.0


def test_oversize_batch_and_kserve_bodies_are_refused_while_streaming(coord: Proc, client: httpx.Client) -> None:
    """Chunked JSON bodies with no Content-Length to the batch and KServe endpoints: 413 while streaming,
    long before the 256 MB offered (the same reader as /v1/classify)."""
    model = client.get("/v2/models").json()["models"][0]["name"]
    for path in ("/v1/classify/batch", f"/v2/models/{model}/infer"):
        head = (
            f"POST {path} HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        ).encode()
        piece = b" " * (256 * 1024)  # JSON whitespace: only the size limit can refuse it
        offered, sent, answer = 256 * 1024 * 1024, 0, b""
        with socket.create_connection(("127.0.0.1", port(coord)), timeout=5) as sock:
            sock.sendall(head + b"1\r\n{\r\n")
            while sent < offered and not answer:
                try:
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    break
                sent += len(piece)
                if select.select([sock], [], [], 0)[0]:
                    answer = sock.recv(65536)
            with contextlib.suppress(ConnectionResetError):
                answer += _read_until_closed(sock, 10)
        assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
        assert sent < offered // 4, f"{path}: the server read {sent} bytes before refusing"


@pytest.mark.parametrize(
    "body",
    [
        b'{"image_base64": 5}',
        WITH_IMAGE + b', "top_k": "five"}',
        WITH_IMAGE + b', "top_k": [1]}',
        WITH_IMAGE + b', "exit_confidence": 1e999}',  # valid JSON, infinite as a float
        WITH_IMAGE + b', "resize": {"a": [1, {"b": 2}]}}',
    ],
)
def test_wrong_types_are_a_422_that_names_the_field(client: httpx.Client, body: bytes) -> None:
    reply = client.post("/v1/classify", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"] == "invalid_request" and reply.json()["detail"][0]["field"]


# --- disconnects and metrics ------------------------------------------------------------------------


def _drain(proc: Proc) -> None:
    while not proc.lines.empty():
        proc.lines.get_nowait()


def test_client_disconnect_is_logged_at_info_without_traceback(coord: Proc, client: httpx.Client) -> None:
    _drain(coord)  # the process's lines from here on arrive in coord.lines
    before = counter(client, "/v1/classify", 499)
    with socket.create_connection(("127.0.0.1", port(coord)), timeout=10) as sock:
        host, local_port = sock.getsockname()
        sock.sendall(
            b"POST /v1/classify HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"image_base64": "'
        )
        time.sleep(0.2)  # let the server start reading the body
    logged: list[str] = []
    while not any(f"client {host}:{local_port} went away" in line for line in logged):
        logged.append(coord.lines.get(timeout=10) or "")  # queue.Empty: not logged within 10 s
    time.sleep(0.2)  # a traceback would follow its log line at once
    while not coord.lines.empty():
        logged.append(coord.lines.get_nowait() or "")
    text = "".join(logged)
    assert " INFO " in text and "Traceback" not in text and " ERROR " not in text, text
    deadline = time.monotonic() + 10
    while counter(client, "/v1/classify", 499) < before + 1:  # counted once the app has seen it end
        assert time.monotonic() < deadline, f"the disconnect was not counted: {text}"


def test_every_status_is_counted_by_endpoint(client: httpx.Client) -> None:
    cases = [
        (lambda: classify_upload(client, png()), "/v1/classify", 200),
        (lambda: classify_upload(client, b"not an image"), "/v1/classify", 400),
        (lambda: classify_upload(client, png((20, 16))), "/v1/classify", 422),
        (
            lambda: client.post("/v1/classify", content=b"x", headers={"content-type": "text/plain"}),
            "/v1/classify",
            415,
        ),
        (lambda: classify_upload(client, b"0" * (UPLOAD_LIMIT + 1)), "/v1/classify", 413),
        (lambda: classify_upload(client, png(), min_blocks="9"), "/v1/classify", 422),  # past the depth of 3
        (lambda: client.get("/v1/nope"), "unmatched", 404),
        (lambda: client.get("/healthz"), "/healthz", 200),
    ]
    for call, endpoint, status in cases:
        before = counter(client, endpoint, status)
        assert call().status_code == status
        assert counter(client, endpoint, status) == before + 1, (endpoint, status)


# --- API keys ----------------------------------------------------------------------------------------

FORM = {"content-type": "application/x-www-form-urlencoded"}


@pytest.fixture(scope="module")
def keyed(family_dirs: list[Path], nodes: list[Proc], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text("# current and next key (rotation)\n" + "\n".join(KEYS) + "\n")
    proc = spawn("coordinator-keyed", coordinator_cmd(family_dirs[0], nodes, "--api-key-file", str(key_file)))
    yield f"http://127.0.0.1:{port(proc)}"
    stop_all([proc])


def test_api_keys_guard_inference_and_leave_probes_open(keyed: str) -> None:
    with httpx.Client(base_url=keyed, timeout=30) as c:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert c.get(path).status_code == 200, path
        refusals = []
        for headers in ({}, {"authorization": "Bearer wrong-key-0123456789"}, {"authorization": f"Basic {KEYS[0]}"}):
            reply = c.post("/v1/classify", files={"file": ("a.png", png(), "image/png")}, headers=headers)
            assert reply.status_code == 401 and reply.json()["error"] == "unauthorized", reply.text
            assert reply.headers["www-authenticate"] == "Bearer"
            refusals.append(reply.json()["detail"])
        assert "not one of this coordinator's keys" in refusals[1]  # a wrong key is not told to send one
        assert refusals[0] == refusals[2] == "send an API key: Authorization: Bearer KEY"
        assert c.get("/v1/nodes").status_code == 401
        docs = c.get("/docs")  # open, and so are the scripts and styles it loads (a browser sends no key)
        assets = re.findall(r"""(?:src|href)=["']?(/static-offline-docs/[^"' >]+)""", docs.text)
        assert docs.status_code == 200 and len(assets) >= 2, docs.text
        assert all(c.get(asset).status_code == 200 for asset in assets), assets
        for headers in ({"authorization": f"Bearer {KEYS[0]}"}, {"x-api-key": KEYS[1]}):
            reply = c.post("/v1/classify", files={"file": ("a.png", png(), "image/png")}, headers=headers)
            assert reply.status_code == 200, reply.text
        assert 'layerswarm_requests_total{endpoint="unrouted",status="401"} 4.0' in c.get("/metrics").text


def test_the_swarm_page_opens_after_a_login_with_a_key(keyed: str) -> None:
    """With --api-key-file a browser could not open `/`: it sends no Authorization header (issue 46). The
    login form takes a key and sets an HttpOnly, SameSite=Strict cookie that opens the page, its assets,
    /v1/swarm and /v1/events, and nothing else; a wrong key is a 401 with JSON and no cookie."""
    with httpx.Client(base_url=keyed, timeout=30) as c:
        browser = c.get("/", headers={"accept": "text/html,application/xhtml+xml"})
        assert browser.status_code == 303 and browser.headers["location"] == "/login"
        assert c.get("/").status_code == 401  # an API client asking for the page is told about keys, in JSON
        form = c.get("/login")
        assert form.status_code == 200 and '<form method="post" action="/login">' in form.text
        assert 'name="key" type="password"' in form.text
        wrong = c.post("/login", data={"key": "wrong-key-0123456789"})
        assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized", wrong.text
        assert "set-cookie" not in wrong.headers
        assert c.post("/login", data={}).status_code == 400
        assert c.post("/login", content=b"key=" + b"k" * 5000, headers=FORM).status_code == 413
        login = c.post("/login", data={"key": KEYS[1]})
        assert login.status_code == 303 and login.headers["location"] == "/", login.text
    cookie = login.headers["set-cookie"]
    attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
    assert {"httponly", "samesite", "path", "max-age"} <= attributes and "secure" not in attributes  # plain HTTP
    assert "samesite=strict" in cookie.lower()
    session = {"cookie": cookie.split(";")[0]}
    with httpx.Client(base_url=keyed, timeout=30, headers=session) as c:
        assert c.get("/").status_code == 200 and "<script" in c.get("/").text
        assert c.get("/static/page.js").status_code == 200
        assert c.get("/v1/swarm").json()["swarm"]["depth"] > 0
        with c.stream("GET", "/v1/events") as events:
            assert events.status_code == 200
            assert next(line for line in events.iter_lines() if line.startswith("event:")) == "event: swarm"
        assert c.get("/v1/nodes").status_code == 401  # never the API: an API call carries its key
        assert c.post("/v1/classify", files={"file": ("a.png", png(), "image/png")}).status_code == 401
    name, token = session["cookie"].split("=", 1)
    expires, mac = token.split(".")
    for forged in (f"{int(expires) + 10**6}.{mac}", f"{expires}.{'0' * 64}", "1.x", ""):
        assert httpx.get(f"{keyed}/v1/swarm", headers={"cookie": f"{name}={forged}"}).status_code == 401


def test_unauthorized_requests_are_refused_before_their_body(keyed: str) -> None:
    host, port_ = keyed.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port_)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/classify HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n"
        )
        answer = _read_until_closed(sock, 10)  # no body sent: the answer cannot have waited for it
    assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()


@pytest.mark.parametrize(("content", "problem"), [("# none\n\n", "holds no API key"), ("short\n", "shorter than 16")])
def test_api_key_file_errors_name_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, problem: str
) -> None:
    from layerswarm.cli import build_parser

    key_file = tmp_path / "keys"
    key_file.write_text(content)
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["coordinator", "--model-dir", "zoo:shapes/layershuffle-0", "--api-key-file", str(key_file)]
        )
    err = capsys.readouterr().err
    assert "--api-key-file" in err and problem in err, err


def test_access_log_and_request_ids(family_dirs: list[Path], nodes: list[Proc]) -> None:
    proc = spawn("coordinator-access-log", coordinator_cmd(family_dirs[0], nodes, "--access-log"))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port(proc)}", timeout=30) as c:
            _drain(proc)
            ours = c.get("/healthz", headers={"x-request-id": "trace-abc.123"})
            assert ours.headers["x-request-id"] == "trace-abc.123"
            fresh = c.post("/v1/classify", content=b"{", headers={"content-type": "application/json"})
            made = fresh.headers["x-request-id"]
            assert fresh.status_code == 400 and re.fullmatch(r"[0-9a-f]{16}", made)
            odd = c.get("/healthz", headers={"x-request-id": "bad id\twith spaces"})
            assert odd.headers["x-request-id"] != "bad id\twith spaces"  # never echoed into logs verbatim
            logged = ""
            deadline = time.monotonic() + 10
            while f"id={made}" not in logged:
                assert time.monotonic() < deadline, logged
                logged += proc.lines.get(timeout=10) or ""
        assert "GET /healthz 200" in logged and "id=trace-abc.123" in logged
        assert "POST /v1/classify 400" in logged
    finally:
        stop_all([proc])
