"""Several coordinators: a node convicted by one is re-checked by the others at once (a tip), never
convicted on another coordinator's word; tips are signed with the swarm token, fresh and used once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from layerswarm.coordinator.membership import tip_sender
from layerswarm.coordinator.membership.tip_sender import TipSender, is_self
from layerswarm.coordinator.membership.tips import (
    MAC_HEADER,
    TIP_COOLDOWN_S,
    TipError,
    TipInbox,
    new_tip,
    sign,
    tip_key,
)
from layerswarm.harness.procs import Proc, coordinator_cmd, spawn, stop_all
from layerswarm.wire.auth import derive_key

from ..lm_nodes import free_port
from ..swarm import address, start_nodes
from .test_attacks_rogue import rogue_cmd
from .test_kserve import png

TOKEN = "a" * 64


def signed(tip_body: bytes, token: str = TOKEN) -> dict[str, str]:
    return {MAC_HEADER: sign(tip_key(token), tip_body), "content-type": "application/json"}


def test_a_tip_is_taken_once_signed_fresh_and_new() -> None:
    now = [1_000_000.0]
    inbox = TipInbox(tip_key(TOKEN), clock=lambda: now[0])
    body = new_tip("10.0.0.7:50051", "boot-1", "re-execution", "http://a:8080", now[0]).body()
    assert inbox.accept(body, sign(tip_key(TOKEN), body)) is not None
    stale = new_tip("10.0.0.8:50051", "boot-2", "re-execution", "http://a:8080", now[0] - 120).body()
    refusals = {
        "replayed": (body, sign(tip_key(TOKEN), body)),
        "unsigned": (body, None),
        "another token": (body, sign(tip_key("b" * 64), body)),
        "a node call's key": (body, sign(derive_key(TOKEN), body)),  # keys are per purpose
        "stale": (stale, sign(tip_key(TOKEN), stale)),
    }
    for what, (refused_body, mac) in refusals.items():
        with pytest.raises(TipError) as refused:
            inbox.accept(refused_body, mac)
        assert refused.value.status == 401, what
    again = new_tip("10.0.0.7:50051", "boot-1", "re-execution", "http://a:8080", now[0]).body()
    assert inbox.accept(again, sign(tip_key(TOKEN), again)) is None  # taken, not acted on: within the cooldown
    now[0] += TIP_COOLDOWN_S + 1
    later = new_tip("10.0.0.7:50051", "boot-1", "re-execution", "http://a:8080", now[0]).body()
    assert inbox.accept(later, sign(tip_key(TOKEN), later)) is not None


GOOD = json.loads(new_tip("10.0.0.7:50051", "boot-1", "r", "s", time.time()).body())


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b"{",
        json.dumps({"address": "x"}).encode(),
        json.dumps({**GOOD, "extra": 1}).encode(),
        json.dumps({**GOOD, "sent_ms": "soon"}).encode(),
        json.dumps({**GOOD, "address": "x" * 300}).encode(),
        json.dumps({**GOOD, "reason": ["a"]}).encode(),
    ],
)
def test_a_malformed_tip_is_a_400(body: bytes) -> None:
    inbox = TipInbox(tip_key(TOKEN))
    with pytest.raises(TipError) as refused:
        inbox.accept(body, sign(tip_key(TOKEN), body))
    assert refused.value.status == 400


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return path


@pytest.fixture
def swarm(family_dirs: list[Path], token_file: Path) -> Iterator[tuple[Proc, list[Proc]]]:
    """Member 0's blocks: a subtle liar (push: range and residual screens pass it) on block 0."""
    model = family_dirs[0]
    rogue = spawn("rogue-push", rogue_cmd(model, 0, "push", "--token-file", str(token_file)))
    honest = start_nodes([(model, b) for b in (1, 2)], "--token-file", str(token_file))
    yield rogue, honest
    stop_all([rogue, *honest])


def coordinator(model: Path, nodes: list[Proc], token_file: Path, *extra: str) -> Proc:
    cmd = coordinator_cmd(model, nodes, "--token-file", str(token_file), "--min-blocks", "2", *extra)
    return spawn("coordinator", cmd)


def url(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.ready['port']}"


def node_state(http: httpx.Client, base: str, node: str) -> str:
    nodes = http.get(f"{base}/v1/nodes").json()["nodes"]
    return str(next(n["state"] for n in nodes if n["address"] == node))


def test_a_liar_convicted_by_one_coordinator_is_caught_by_the_other_within_5_requests(
    family_dirs: list[Path], token_file: Path, swarm: tuple[Proc, list[Proc]]
) -> None:
    rogue, honest = swarm
    nodes, liar = [rogue, *honest], address(rogue)
    # B never checks a hop by itself (no sample, no probation, no decisive hop): only a tip makes it look.
    b = coordinator(family_dirs[0], nodes, token_file, "--verify-rate", "0", "--verify-probation", "0",
                    "--verify-decisive", "0")  # fmt: skip
    a = None
    try:
        with httpx.Client(timeout=30) as http:
            for _ in range(3):
                assert http.post(f"{url(b)}/v1/classify", files={"file": png(1)}).status_code == 200
            assert node_state(http, url(b), liar) == "healthy"  # B alone does not see the lie
            a = coordinator(family_dirs[0], nodes, token_file, "--verify-rate", "1", "--coordinator-peer", url(b))
            http.post(f"{url(a)}/v1/classify", files={"file": png(1)})
            assert node_state(http, url(a), liar) == "quarantined"
            deadline = time.monotonic() + 10
            while not any(f"convicted {liar}" in line for line in b.output) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert any(f"convicted {liar}" in line for line in b.output), b.output[-20:]  # the tip arrived
            for _ in range(5):
                http.post(f"{url(b)}/v1/classify", files={"file": png(1)})
                if node_state(http, url(b), liar) == "quarantined":
                    break
            assert node_state(http, url(b), liar) == "quarantined", "not caught within 5 requests"
            view = next(n for n in http.get(f"{url(b)}/v1/nodes").json()["nodes"] if n["address"] == liar)
            assert view["evidence"][0]["check"] == "re-execution"  # B's own evidence, not A's word
            # An honest node tipped (a compromised member may sign tips too) is re-checked, not convicted.
            fair = address(honest[0])
            tip = new_tip(fair, "whatever", "a lie", "http://forger", time.time()).body()
            assert http.post(f"{url(b)}/v1/swarm/tips", content=tip, headers=signed(tip)).json() == {"acted": True}
            for _ in range(10):
                assert http.post(f"{url(b)}/v1/classify", files={"file": png(1)}).status_code == 200
            assert node_state(http, url(b), fair) == "healthy"
            # Without the token a tip is refused, with the reason.
            forged = new_tip(fair, "x", "y", "z", time.time()).body()
            refused = http.post(f"{url(b)}/v1/swarm/tips", content=forged, headers=signed(forged, "c" * 64))
            assert refused.status_code == 401 and refused.json()["error"] == "tip_refused"
    finally:
        stop_all([p for p in (a, b) if p is not None])


REPLICAS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")  # one service name, three replicas on one port


class Inbox(BaseHTTPRequestHandler):
    """A replica's tip endpoint: keeps each tip whose MAC is the swarm token's."""

    got: list[tuple[str, str]]  # (the replica's own address, the tipped node)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        ok = self.headers.get(MAC_HEADER) == sign(tip_key(TOKEN), body)
        if ok:
            self.got.append((self.server.server_address[0], json.loads(body)["address"]))
        self.send_response(200 if ok else 401)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def replicas() -> Iterator[tuple[int, list[tuple[str, str]]]]:
    """Three real HTTP servers on 127.0.0.1-3, all on one port, as a service's replicas are."""
    port, got = free_port(), []
    handler = type("ReplicaInbox", (Inbox,), {"got": got})
    servers = [ThreadingHTTPServer((address, port), handler) for address in REPLICAS]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    yield port, got
    for server in servers:
        server.shutdown()
        server.server_close()


async def test_a_tip_to_a_service_name_reaches_every_replica_but_the_sender(
    replicas: tuple[int, list[tuple[str, str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, got = replicas
    asked: list[str] = []

    async def resolver(host: str, at: int) -> list[str]:  # the service's DNS: every replica's A record
        asked.append(host)
        return list(REPLICAS) if host == "coordinators" else await tip_sender.resolve(host, at)

    # The sender is the replica on 127.0.0.1: the name's other two addresses are told, it is not.
    sender = TipSender((f"http://coordinators:{port}",), tip_key(TOKEN), "127.0.0.1", port, resolver=resolver)
    try:
        sender.convicted("10.0.0.7:50051", "boot-1", "re-execution")
        deadline = time.monotonic() + 10
        while sender._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await sender.close()
    assert sorted(got) == [("127.0.0.2", "10.0.0.7:50051"), ("127.0.0.3", "10.0.0.7:50051")]
    assert sender.sent == 2 and sender.failed == 0
    assert "coordinators" in asked  # resolved when the tip was sent, not once at start


def test_only_our_own_address_and_port_are_left_out() -> None:
    port = 8080
    assert is_self("127.0.0.1", port, ({"127.0.0.1"}, port))
    assert not is_self("127.0.0.2", port, ({"127.0.0.1"}, port))  # bound to one address: the others are not us
    assert not is_self("127.0.0.1", port + 1, ({"127.0.0.1"}, port))
    # Bound to every address: any of this host's own at our port is us, anyone else's is not (a bind
    # probe: nothing is sent).
    assert is_self("127.0.0.2", port, ({"0.0.0.0"}, port))
    assert not is_self("192.0.2.10", port, ({"0.0.0.0"}, port))
