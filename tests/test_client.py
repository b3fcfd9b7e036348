"""layerswarm.client against a real coordinator and nodes: typed results, batches, and retries only
where a later try can succeed (connect errors, 429, 503), counted on the wire."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from layerswarm.client import AsyncSwarmClient, BatchClassification, Classification, SwarmClient, SwarmError
from layerswarm.harness.procs import Proc, coordinator_cmd, launch, stop_all, wait_for_ready_line

from .swarm import coordinator_process
from .test_kserve import png

pytestmark = pytest.mark.slow


@pytest.fixture
def base_url(api_swarm: str) -> str:
    return api_swarm


def counting(base_url: str) -> tuple[httpx.Client, list[str]]:
    """An httpx client that records every request it sends (to count retries)."""
    sent: list[str] = []
    http = httpx.Client(base_url=base_url, timeout=30, event_hooks={"request": [lambda r: sent.append(r.url.path)]})
    return http, sent


def test_classify_and_batch_give_typed_results(base_url: str, tmp_path: Path) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(png(1))
    with SwarmClient(base_url) as swarm:
        assert swarm.ready()
        one = swarm.classify(image, top_k=2, seed=3, label="a")
        assert isinstance(one, Classification) and len(one.labels) == 2 and one.seed == 3
        assert one.prediction == one.labels[0].label and [h.block for h in one.trace.hops] == [0, 1, 2]
        raw = httpx.post(f"{base_url}/v1/classify", files={"file": ("a.png", png(1))}, data={"top_k": "2"}).json()
        assert one.prediction == raw["prediction"] and one.labels[0].probability == raw["labels"][0]["probability"]
        batch = swarm.classify_batch([png(1), png(2)], labels=["a", "b"], top_k=1)
        assert isinstance(batch, BatchClassification) and batch.predictions[0] == one.prediction
        assert len(batch.results) == 2 and batch.depth == 3
        view = swarm.swarm()
        assert view.ready and view.reachable_depth == 3 and {n.state for n in view.nodes} == {"healthy"}
        with pytest.raises(SwarmError) as bad:
            swarm.classify(b"not an image")
        assert bad.value.status == 400 and bad.value.error == "invalid_image" and not bad.value.retryable


def test_client_errors_are_not_retried(base_url: str) -> None:
    http, sent = counting(base_url)
    with SwarmClient(http=http, attempts=5) as swarm, pytest.raises(SwarmError) as error:
        swarm.classify(png(0), top_k=0)
    assert error.value.status == 422 and sent == ["/v1/classify"]


def test_503_is_retried_with_backoff_then_raised(family_dirs: list[Path]) -> None:
    coord = coordinator_process(family_dirs[0], [])  # no nodes: every request is 503 insufficient_depth
    try:
        http, sent = counting(f"http://127.0.0.1:{coord.ready['port']}")
        with SwarmClient(http=http, attempts=3, max_backoff_s=0.1) as swarm, pytest.raises(SwarmError) as error:
            swarm.classify(png(0))
        assert error.value.status == 503 and error.value.error == "insufficient_depth"
        assert sent == ["/v1/classify"] * 3
    finally:
        stop_all([coord])


def test_connect_errors_are_retried_until_the_coordinator_is_up(family_dirs: list[Path]) -> None:
    with socket.socket() as probe:  # a free port, for a coordinator that is not started yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [*coordinator_cmd(family_dirs[0], []), "--http-port", str(port)]
    client = SwarmClient(f"http://127.0.0.1:{port}", attempts=200, max_backoff_s=0.5)
    assert not client.ready()
    coord: Proc = launch("coordinator-late", cmd)
    try:
        view = client.swarm()  # connection refused until the coordinator serves, then an answer
        assert view.depth == 3 and not view.ready
        wait_for_ready_line(coord)
    finally:
        client.close()
        stop_all([coord])


async def test_async_client(base_url: str) -> None:
    async with AsyncSwarmClient(base_url) as swarm:
        assert await swarm.ready()
        one = await swarm.classify(png(4), top_k=1)
        batch = await swarm.classify_batch([png(4), png(5)])
        assert batch.predictions[0] == one.prediction and (await swarm.swarm()).reachable_depth == 3
