"""Several coordinators behind one client: a call that cannot reach one goes to the next at once, and
stays there; a classification that broke after it was sent is sent again (idempotent), a generation is
not (it may have been answered)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from layerswarm.client import SwarmClient, SwarmError
from layerswarm.client.bodies import Failover
from layerswarm.harness.procs import stop_all

from ..coordinator.test_kserve import png
from ..swarm import coordinator_process, start_nodes

A, B = "http://coordinator-a.test", "http://coordinator-b.test"
ANSWER = {"error": "never_sent"}


def fake_coordinators(broken: str, failure: type[httpx.TransportError]) -> tuple[httpx.Client, list[str]]:
    """Two coordinators in an httpx transport: `broken` fails every call with `failure`, the other
    answers each path with a minimal body. Only the client's policy is under test here; the real
    processes are in the slow test below."""
    sent: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(f"{request.url.scheme}://{request.url.host}{request.url.path}")
        if str(request.url).startswith(broken):
            raise failure("broken", request=request)
        return httpx.Response(200, json={"ok": True})

    return httpx.Client(transport=httpx.MockTransport(handle), base_url=A), sent


def test_the_next_coordinator_is_tried_at_once_and_kept() -> None:
    http, sent = fake_coordinators(A, httpx.ConnectError)
    with SwarmClient([A, B], http=http, attempts=1) as swarm:
        assert swarm._call("GET", "/v1/nodes", {}) == {"ok": True}
        assert swarm.base_url == B
        swarm._call("GET", "/v1/nodes", {})
    assert sent == [f"{A}/v1/nodes", f"{B}/v1/nodes", f"{B}/v1/nodes"]  # the second call stays on B


def test_a_broken_classification_is_sent_again_but_a_generation_is_not() -> None:
    http, sent = fake_coordinators(A, httpx.ReadError)  # the connection broke after the request went out
    with SwarmClient([A, B], http=http, attempts=1) as swarm:
        assert swarm._call("POST", "/v1/classify", {"json": {}}) == {"ok": True}
    assert sent == [f"{A}/v1/classify", f"{B}/v1/classify"]
    http, sent = fake_coordinators(A, httpx.ReadError)
    with SwarmClient([A, B], http=http, attempts=3) as swarm, pytest.raises(httpx.ReadError):
        swarm.generate("1+1=", max_tokens=2)
    assert sent == [f"{A}/v1/generate"]  # never twice: the first may have produced an answer


@pytest.mark.parametrize("failure", [httpx.WriteError, httpx.WriteTimeout])
def test_a_request_cut_off_while_being_written_goes_to_the_next_coordinator(
    failure: type[httpx.TransportError],
) -> None:
    """A coordinator killed while a client uploads its image breaks the write (seen once in the
    several-coordinator chaos run as a lost request): nothing reached a coordinator whole, so even a
    generation is sent to the next one."""
    http, sent = fake_coordinators(A, failure)
    with SwarmClient([A, B], http=http, attempts=1) as swarm:
        assert swarm._call("POST", "/v1/classify", {"json": {}}) == {"ok": True}
        assert swarm._call("POST", "/v1/generate", {"json": {}}, idempotent=False) == {"ok": True}
    assert sent == [f"{A}/v1/classify", f"{B}/v1/classify", f"{B}/v1/generate"]
    http, sent = fake_coordinators(A, failure)
    with SwarmClient([A, B], http=http, attempts=1) as swarm:
        assert swarm._call("POST", "/v1/generate", {"json": {}}, idempotent=False) == {"ok": True}
    assert sent == [f"{A}/v1/generate", f"{B}/v1/generate"]


def test_a_round_backs_off_only_once_every_coordinator_was_tried() -> None:
    failover = Failover((A, B, "http://coordinator-c.test"))
    failover.start_call()
    assert not failover.mid_round()
    failover.advance()
    assert failover.mid_round() and failover.current == B
    failover.advance()
    assert failover.mid_round()
    failover.advance()
    assert not failover.mid_round() and failover.current == A  # all three tried: back off, then A again
    with pytest.raises(ValueError, match="base_url"):
        SwarmClient([])


@pytest.mark.slow
def test_a_killed_coordinator_costs_no_request(family_dirs: list[Path]) -> None:
    """Two real coordinators on the same three nodes; the one the client uses is SIGKILLed between
    calls: every later call is answered by the other, with no error and no backoff."""
    nodes = start_nodes([(family_dirs[0], b) for b in range(3)])
    coords = [coordinator_process(family_dirs[0], nodes, "--health-interval", "0.2") for _ in range(2)]
    urls = [f"http://127.0.0.1:{c.ready['port']}" for c in coords]
    sent: list[str] = []
    http = httpx.Client(timeout=30, event_hooks={"request": [lambda r: sent.append(f"{r.url.host}:{r.url.port}")]})
    try:
        with SwarmClient(urls, http=http, attempts=1) as swarm:
            first = swarm.classify(png(1), seed=1)
            assert swarm.base_url == urls[0]
            coords[0].popen.send_signal(signal.SIGKILL)
            coords[0].popen.wait(10)
            later = [swarm.classify(png(1), seed=1) for _ in range(10)]
            assert swarm.base_url == urls[1]
        assert all(r.prediction == first.prediction for r in later)
        a, b = (u.removeprefix("http://") for u in urls)
        assert sent == [a, a, *[b] * 10], json.dumps(sent)  # one refused connect, then the other only
    finally:
        stop_all([*coords, *nodes])


def test_errors_about_the_request_are_not_failed_over() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"error": "invalid_request", "detail": "top_k"})

    http = httpx.Client(transport=httpx.MockTransport(handle), base_url=A)
    with SwarmClient([A, B], http=http, attempts=3) as swarm, pytest.raises(SwarmError) as error:
        swarm._call("POST", "/v1/classify", {"json": {}})
    assert error.value.status == 422 and swarm.base_url == A
