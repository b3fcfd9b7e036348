"""The soak's flatness check (issue 43: every coordinator's RSS and open files flat from minute 5 to the
end, within 3%) and what it samples of a real process. The check must fail a series that grows after
warm-up, however flat its start, and must not blame the warm-up itself or a drop."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from layerswarm.chaos.resources import flatness, heap_metrics, proc_resources
from layerswarm.chaos.soak import flat_checks, start_end, stayed_flat
from layerswarm.wire.memory import malloc_usage


def _series(values: list[float], every_s: float = 60.0, key: str = "rss_kib") -> list[dict[str, Any]]:
    return [{"at_s": i * every_s, key: v} for i, v in enumerate(values)]


def test_warm_up_growth_before_minute_5_does_not_count() -> None:
    check = flatness(
        _series([200_000, 280_000, 300_000, 305_000, 308_000, 310_000, 311_000, 312_000, 310_500]), "rss_kib"
    )
    assert check["from_s"] == 300.0 and check["baseline"] == 310_000
    assert check["max"] == 312_000 and check["flat"] is True
    assert check["max_drift_pct"] == pytest.approx(0.65, abs=0.01)
    assert check["end_drift_pct"] == pytest.approx(0.16, abs=0.01)


def test_growth_after_minute_5_past_3_percent_fails() -> None:
    values = [300_000.0] * 6 + [300_000 + 1_000 * i for i in range(1, 11)]  # +1 MB a minute: +3.3% at the end
    check = flatness(_series(values), "rss_kib")
    assert check["baseline"] == 300_000 and check["flat"] is False
    assert check["max_drift_pct"] == pytest.approx(3.33, abs=0.01)


def test_a_peak_in_the_middle_fails_even_when_the_end_is_back() -> None:
    check = flatness(_series([100.0] * 6 + [104.0, 100.0]), "rss_kib")
    assert check["flat"] is False and check["end_drift_pct"] == 0.0


def test_a_drop_is_not_growth() -> None:
    check = flatness(_series([37.0] * 6 + [32.0], key="fds"), "fds")
    assert check["flat"] is True and check["end_drift_pct"] < 0


def test_the_baseline_is_the_first_sample_at_or_after_minute_5_and_gaps_are_skipped() -> None:
    samples: list[dict[str, Any]] = [{"at_s": 0.0, "rss_kib": 1}, {"at_s": 290.0}, {"at_s": 310.0, "rss_kib": 100}]
    samples.append({"at_s": 400.0, "rss_kib": 103})
    check = flatness(samples, "rss_kib")
    assert check["from_s"] == 310.0 and check["baseline"] == 100 and check["flat"] is True


def test_a_run_shorter_than_5_minutes_has_no_verdict() -> None:
    check = flatness(_series([1.0, 2.0, 3.0]), "rss_kib")
    assert check["flat"] is None and check["baseline"] is None


def test_every_coordinator_is_checked_on_its_own() -> None:
    def sample(at: float, a: int, b: int) -> dict[str, Any]:
        both = {"a": {"pid": 1, "rss_kib": a, "fds": 30}, "b": {"pid": 2, "rss_kib": b, "fds": 30}}
        return {"at_s": at, "nodes": {}, "coordinators": both}

    samples = [sample(60.0 * i, 100, 100) for i in range(6)] + [sample(360.0, 101, 110)]
    checks = flat_checks(samples)
    assert checks["a"]["rss_kib"]["flat"] is True
    assert checks["b"]["rss_kib"]["flat"] is False  # one growing coordinator is not hidden by the other
    assert checks["a"]["fds"]["flat"] is True
    assert stayed_flat({"flat": {"coordinators": checks}}) is False  # the soak's exit status: 1
    assert stayed_flat({"flat": {"coordinators": {"a": checks["a"]}}}) is True
    ends = start_end(samples)["coordinators"]
    assert ends["b"]["start"]["rss_kib"] == 100 and ends["b"]["end"]["rss_kib"] == 110


def test_heap_usage_is_read_from_glibc() -> None:
    usage = malloc_usage()
    if usage is None:
        pytest.skip("not glibc 2.33+")
    before = usage["in_use"]
    held = [bytearray(4096) for _ in range(2000)]  # 8 MB handed out and not freed
    after = malloc_usage()
    assert after is not None and after["in_use"] - before >= 7_000_000
    del held


def test_a_live_process_is_sampled_with_its_connections_counted_apart() -> None:
    """A real child process listening (its "HTTP" port) and dialling a listener here (its "node"): RSS and
    descriptors read from /proc, and the connections clients hold to it and those it holds to nodes
    counted apart from its own descriptors (load and swarm size, not the process's state)."""
    node = socket.socket()
    node.bind(("127.0.0.1", 0))
    node.listen()
    node_port = node.getsockname()[1]
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    code = (
        "import socket, sys, time\n"
        f"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', {port}))\n"
        f"s.listen(); out = [socket.create_connection(('127.0.0.1', {node_port})) for _ in range(2)]\n"
        "print('ready', flush=True)\n"
        "held = [s.accept()[0] for _ in range(3)]\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    clients: list[socket.socket] = []
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        idle = proc_resources(child.pid, port, node_port)
        assert idle is not None and idle["rss_kib"] > 1000
        assert idle["http_clients"] == 0 and idle["node_connections"] == 2
        assert idle["fds_held"] == idle["fds"] - 2
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        deadline = time.monotonic() + 10
        busy = proc_resources(child.pid, port, node_port)
        while busy is not None and busy["http_clients"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
            busy = proc_resources(child.pid, port, node_port)
        assert busy is not None and busy["http_clients"] == 3
        assert busy["fds"] == idle["fds"] + 3 and busy["fds_held"] == idle["fds_held"]
    finally:
        for c in clients:
            c.close()
        node.close()
        child.kill()  # by PID: the child started here
        child.wait()
    assert proc_resources(child.pid) is None  # gone: no sample, no error


def test_heap_metrics_of_nothing_listening_is_none() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    assert heap_metrics(f"http://127.0.0.1:{port}", timeout_s=2.0) is None
