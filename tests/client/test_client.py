"""layerswarm.client against a real coordinator and nodes: typed results, batches, API keys, and retries
only where a later try can succeed (connect errors, 429, 503), counted on the wire; and the client's
options and results against the HTTP API's own request and response models, so the two cannot drift."""

from __future__ import annotations

import socket
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import httpx
import pytest

from layerswarm.client import (
    AsyncSwarmClient,
    Attempt,
    BatchClassification,
    Classification,
    Hop,
    Options,
    SwarmClient,
    SwarmError,
    Trace,
)
from layerswarm.coordinator.http.schemas import ClassifyParams, ClassifyResponse
from layerswarm.coordinator.routing.trace import AttemptJson, HopJson
from layerswarm.harness.procs import Proc, coordinator_cmd, launch, stop_all, wait_for_ready_line

from ..coordinator.test_kserve import png
from ..swarm import coordinator_process


@pytest.fixture
def base_url(api_swarm: str) -> str:
    return api_swarm


def counting(base_url: str) -> tuple[httpx.Client, list[str]]:
    """An httpx client that records every request it sends (to count retries)."""
    sent: list[str] = []
    http = httpx.Client(base_url=base_url, timeout=30, event_hooks={"request": [lambda r: sent.append(r.url.path)]})
    return http, sent


def _without_none(annotation: object) -> object:
    """`X | None` -> X: the API's None means "the coordinator's default", which the client expresses by
    leaving the option out."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kept = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kept[0] if len(kept) == 1 else typing.Union[tuple(kept)]  # noqa: UP007
    return annotation


def test_client_options_are_every_option_of_the_http_api() -> None:
    """Every option the HTTP API reads (ClassifyParams) is a keyword of classify() with the same type
    (`label` is the calls' own argument); an option added to one side only fails here."""
    api = {name: _without_none(field.annotation) for name, field in ClassifyParams.model_fields.items()}
    client = typing.get_type_hints(Options)
    assert set(client) | {"label"} == set(api), set(client) ^ (set(api) - {"label"})
    assert {name: client[name] for name in client} == {name: api[name] for name in client}


def test_client_results_read_every_field_of_the_http_answer() -> None:
    assert {f.name for f in fields(Classification)} == set(ClassifyResponse.model_fields)
    assert {f.name for f in fields(Hop)} <= set(get_type_hints(HopJson))  # the client keeps what users read
    assert {f.name for f in fields(Attempt)} == set(get_type_hints(AttemptJson))


def test_a_substituted_hop_says_which_call_failed_and_why() -> None:
    failed = {"node": "10.0.0.5:50051", "model_id": "m0", "block": 1, "error": "UNAVAILABLE: unreachable"}
    hop = {"position": 1, "planned_block": 1, "block": 1, "node": "10.0.0.6:50051", "model_id": "m0"}
    hop |= {"latency_ms": 3.0, "outcome": "substituted", "attempts": [failed]}
    trace = Trace.from_json({"hops": [hop], "unreachable_blocks": [], "substituted": 1, "skipped": 0})
    assert trace.hops[0].attempts == (Attempt("10.0.0.5:50051", "m0", 1, "UNAVAILABLE: unreachable"),)


@pytest.mark.slow
def test_api_key_is_sent_on_every_call(family_dirs: list[Path], tmp_path: Path) -> None:
    key = "k-" + "7" * 30
    (tmp_path / "keys").write_text(f"# clients\n{key}\n")
    coord = coordinator_process(family_dirs[0], [], "--api-key-file", str(tmp_path / "keys"))
    base_url = f"http://127.0.0.1:{coord.ready['port']}"
    try:
        with SwarmClient(base_url, api_key=key) as swarm:
            assert swarm.swarm().depth == 3
        for wrong in (None, "k-" + "8" * 30):
            http, sent = counting(base_url)
            with SwarmClient(http=http, api_key=wrong, attempts=3) as swarm, pytest.raises(SwarmError) as refused:
                swarm.swarm()
            assert refused.value.status == 401 and sent == ["/v1/nodes"]  # not retried: another try fails alike
    finally:
        stop_all([coord])
    with pytest.raises(ValueError, match="api_key"):
        SwarmClient(base_url, api_key=" ")


@pytest.mark.slow
def test_every_option_reaches_the_coordinator(base_url: str) -> None:
    """The newer options change the answer as the API documents: two routes averaged, no early exit, a
    generous deadline, repeats off."""
    with SwarmClient(base_url) as swarm:
        result = swarm.classify(
            png(2),
            ensemble=2,
            ensemble_mode="parallel",
            ensemble_over="orders",
            exit_rule="none",
            deadline_ms=60_000,
            repeats=False,
            seed=1,
        )
    assert result.routes == 2 and result.exit_rule is None and not result.anytime and result.blocks == 6


@pytest.mark.slow
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


@pytest.mark.slow
def test_client_errors_are_not_retried(base_url: str) -> None:
    http, sent = counting(base_url)
    with SwarmClient(http=http, attempts=5) as swarm, pytest.raises(SwarmError) as error:
        swarm.classify(png(0), top_k=0)
    assert error.value.status == 422 and sent == ["/v1/classify"]


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
async def test_async_client(base_url: str) -> None:
    async with AsyncSwarmClient(base_url) as swarm:
        assert await swarm.ready()
        one = await swarm.classify(png(4), top_k=1)
        batch = await swarm.classify_batch([png(4), png(5)])
        assert batch.predictions[0] == one.prediction and (await swarm.swarm()).reachable_depth == 3
