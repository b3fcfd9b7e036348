"""The HTTP contract of a real coordinator process: answers, traces, and a JSON 4xx for every bad input."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from layerswarm.harness.procs import Proc, stop_all

from ..swarm import address, coordinator_process, start_nodes

pytestmark = pytest.mark.slow


def png(size: tuple[int, int] = (16, 16), seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def swarm(family_dirs: list[Path]) -> Iterator[tuple[httpx.Client, list[Proc]]]:
    nodes = start_nodes([(family_dirs[0], b) for b in range(3)])
    coord = coordinator_process(family_dirs[0], nodes[:2], "--health-interval", "0.2", "--max-upload-bytes", "50000")
    client = httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=20)
    try:
        yield client, nodes
    finally:
        client.close()
        stop_all([coord, *nodes])


@pytest.fixture
def client(swarm: tuple[httpx.Client, list[Proc]]) -> httpx.Client:
    return swarm[0]


def test_classify_upload_returns_labels_and_trace(client: httpx.Client) -> None:
    reply = client.post(
        "/v1/classify",
        files={"file": ("a.png", png(), "image/png")},
        data={"top_k": "3", "policy": "sequential", "seed": "7"},
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert len(body["labels"]) == 3 and body["prediction"] == body["labels"][0]["label"]
    assert body["labels"][0]["label"] in ("a", "b", "c", "d")
    probs = [label["probability"] for label in body["labels"]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001
    assert body["policy"] == "sequential" and body["seed"] == 7 and body["depth"] == 2
    hops = body["trace"]["hops"]
    assert [h["block"] for h in hops] == [0, 1] and body["trace"]["unreachable_blocks"] == [2]
    assert all(h["node"] and h["model_id"] and h["latency_ms"] > 0 and h["position"] == i for i, h in enumerate(hops))


def test_classify_json_base64_matches_upload(client: httpx.Client) -> None:
    image = png(seed=3)
    upload = client.post("/v1/classify", files={"file": ("a.png", image, "image/png")}, data={"seed": "5"}).json()
    as_json = client.post("/v1/classify", json={"image_base64": base64.b64encode(image).decode(), "seed": 5}).json()
    assert (
        upload["labels"] == as_json["labels"]
        and upload["trace"]["hops"][0]["block"] == as_json["trace"]["hops"][0]["block"]
    )


@pytest.mark.parametrize(
    ("kwargs", "status", "error"),
    [
        ({"files": {"file": ("a.png", b"not an image", "image/png")}}, 400, "invalid_image"),
        ({"files": {"file": ("a.png", b"", "image/png")}}, 400, "empty_image"),
        ({"files": {"file": ("a.png", png((20, 16)), "image/png")}}, 422, "wrong_size"),
        ({"files": {"file": ("a.png", png(), "image/png")}, "data": {"colour": "red"}}, 422, "invalid_request"),
        ({"files": {"file": ("a.png", png(), "image/png")}, "data": {"policy": "random"}}, 422, "invalid_request"),
        ({"files": {"file": ("a.png", png(), "image/png")}, "data": {"top_k": "0"}}, 422, "invalid_request"),
        ({"files": {"file": ("a.png", png(), "image/png")}, "data": {"max_blocks": "x"}}, 422, "invalid_request"),
        ({"data": {"top_k": "1"}}, 415, "unsupported_media_type"),
        ({"files": {"picture": ("a.png", png(), "image/png")}}, 422, "invalid_request"),
        ({"json": {"image_base64": "%%%"}}, 400, "invalid_base64"),
        ({"json": {"image": "abc"}}, 422, "invalid_request"),
        ({"content": b"{nope", "headers": {"content-type": "application/json"}}, 400, "invalid_json"),
        ({"content": b"\x00" * 5, "headers": {"content-type": "application/json"}}, 400, "invalid_json"),  # fuzzer
        ({"content": b"x", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type"),
        ({"files": {"file": ("a.png", b"0" * 60000, "image/png")}}, 413, "too_large"),
    ],
)
def test_bad_input_gets_a_json_4xx(client: httpx.Client, kwargs: dict, status: int, error: str) -> None:  # type: ignore[type-arg]
    reply = client.post("/v1/classify", **kwargs)
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["error"] == error and body["detail"]


def test_error_details_name_what_to_fix(client: httpx.Client) -> None:
    """Not an internal object's repr, the setting behind a limit, a cut-short body as malformed."""
    bad = client.post("/v1/classify", files={"file": ("a.png", b"not an image", "image/png")}).json()
    assert "BytesIO" not in bad["detail"] and "PNG" in bad["detail"]
    large = client.post("/v1/classify", files={"file": ("a.png", b"0" * 200_000, "image/png")})
    assert large.status_code == 413 and "--max-upload-bytes" in large.json()["detail"]
    cut = b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n\r\n' + png()[:100]
    short = client.post("/v1/classify", content=cut, headers={"content-type": "multipart/form-data; boundary=x"})
    assert short.status_code == 400 and short.json()["error"] == "invalid_multipart", short.text


def test_resize_option_accepts_other_sizes(client: httpx.Client) -> None:
    reply = client.post("/v1/classify", files={"file": ("a.png", png((40, 24)), "image/png")}, data={"resize": "true"})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"min_blocks": 1000}, "past the model's depth of 3 blocks"),
        ({"min_blocks": 4}, "past the model's depth of 3 blocks"),
        ({"min_blocks": 2, "max_blocks": 1}, "above max_blocks 1"),
    ],
)
def test_options_no_node_could_serve_are_the_callers_error_and_never_eject_a_node(
    client: httpx.Client, options: dict[str, int], why: str
) -> None:
    """A path longer than the model would send hops at positions no node serves; every node would
    refuse them and be ejected for it (a new user's trial did this with min_blocks 1000)."""
    image = base64.b64encode(png()).decode()
    for _ in range(6):  # more than the ejection threshold of consecutive failures
        reply = client.post("/v1/classify", json={"image_base64": image, **options})
        assert reply.status_code == 422 and reply.json()["error"] == "invalid_request"
        assert why in reply.json()["detail"]
    view = client.get("/v1/nodes").json()
    assert all(n["state"] == "healthy" for n in view["nodes"]) and view["reachable_depth"] == 2


def test_too_few_blocks_is_a_503_that_says_why(client: httpx.Client) -> None:
    reply = client.post("/v1/classify", files={"file": ("a.png", png(), "image/png")}, data={"min_blocks": "3"})
    assert reply.status_code == 503
    assert reply.json()["error"] == "insufficient_depth" and "minimum 3" in reply.json()["detail"]


def test_early_exit_stops_once_confident(client: httpx.Client) -> None:
    body = client.post(
        "/v1/classify",
        files={"file": ("a.png", png(), "image/png")},
        data={"exit_confidence": "0.01", "policy": "sequential"},
    ).json()
    assert body["exited_early"] is True and body["depth"] == 1
    body = client.post(
        "/v1/classify",
        files={"file": ("a.png", png(), "image/png")},
        data={"exit_confidence": "1.0", "policy": "sequential"},
    ).json()
    assert body["exited_early"] is False and body["depth"] == 2


def test_nodes_probes_metrics_and_openapi(client: httpx.Client, swarm: tuple[httpx.Client, list[Proc]]) -> None:
    view = client.get("/v1/nodes").json()
    assert view["depth"] == 3 and view["reachable_depth"] == 2 and view["ready"] is True
    assert {n["address"] for n in view["nodes"]} == {address(n) for n in swarm[1][:2]}
    assert all(n["state"] == "healthy" and n["weights_sha256"] for n in view["nodes"])
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    metrics = client.get("/metrics").text
    assert "layerswarm_requests_total" in metrics and 'layerswarm_nodes{state="healthy"} 2.0' in metrics
    # Where its memory is (coordinator/metrics.py): what a soak reads to tell a leak from retention.
    assert "layerswarm_python_blocks " in metrics and 'layerswarm_malloc_bytes{kind="free"}' in metrics
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/classify"]["post"]["requestBody"]["content"]
    assert {"multipart/form-data", "application/json"} <= set(body)
    assert client.get("/v1/nope").json()["error"] == "http_error"


def test_a_min_blocks_setting_past_the_depth_is_refused_at_start(family_dirs: list[Path]) -> None:
    from layerswarm.coordinator import Coordinator, CoordinatorSettings

    with pytest.raises(ValueError, match="--min-blocks 4 is past the model's depth of 3"):
        Coordinator(CoordinatorSettings(model_dir=family_dirs[0], min_blocks=4, mdns=False))
