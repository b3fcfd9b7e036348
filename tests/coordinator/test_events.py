"""The swarm page's event stream from a real coordinator process, without a browser: well-formed
server-sent events, one snapshot each, and a stream that ends cleanly when the coordinator stops
(uvicorn would otherwise wait for open pages, then cut them off)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from layerswarm.harness.procs import stop_all

from ..swarm import coordinator_process

pytestmark = pytest.mark.slow


def events(lines: list[str]) -> list[dict[str, str]]:
    parsed, current = [], {}
    for line in lines:
        if not line:
            if current:
                parsed.append(current)
            current = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(": ")
            current[key] = value
    return parsed


def test_event_stream_sends_snapshots_and_ends_cleanly_on_shutdown(family_dirs: list[Path]) -> None:
    coord = coordinator_process(family_dirs[0], [])
    try:
        url = f"http://127.0.0.1:{coord.ready['port']}/v1/events"
        lines: list[str] = []
        with httpx.stream("GET", url, timeout=30) as reply:
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
            for line in reply.iter_lines():  # ends without an error only if the server ends the stream
                lines.append(line)
                if len(events(lines)) == 2 and coord.alive:
                    coord.signal(signal.SIGTERM)
        received = events(lines)
        assert [e["id"] for e in received[:2]] == ["1", "2"] and all(e["event"] == "swarm" for e in received)
        snapshot = json.loads(received[0]["data"])
        assert snapshot["swarm"]["depth"] == 3 and not snapshot["swarm"]["ready"] and snapshot["nodes"] == []
        coord.popen.wait(10)  # (uvicorn re-raises SIGTERM once it has shut down: exit status -15)
    finally:
        stop_all([coord])
