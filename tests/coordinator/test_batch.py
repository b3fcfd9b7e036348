"""Batches in the native API, against real processes: several files or a JSON list, one path and one
call per hop for the whole batch, each item its own answer, a clear 4xx past the limits."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import pytest

from .test_kserve import png

pytestmark = pytest.mark.slow
ONE = {"image_base64": base64.b64encode(png(0)).decode()}


@pytest.fixture
def client(api_swarm: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_swarm, timeout=30) as c:
        yield c


def single(client: httpx.Client, image: bytes) -> dict[str, object]:
    reply = client.post("/v1/classify", files={"file": ("a.png", image)}, data={"top_k": "2"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def served(client: httpx.Client) -> dict[str, int]:
    return {n["address"]: n["served"] for n in client.get("/v1/nodes").json()["nodes"]}


def test_multipart_batch_one_call_per_hop_each_item_its_answer(client: httpx.Client) -> None:
    images = [png(seed) for seed in range(4)]
    alone = [single(client, image) for image in images]
    before = served(client)
    files = [("file", (f"{i}.png", image, "image/png")) for i, image in enumerate(images)]
    wrong = next(c for c in "abcd" if c != alone[3]["prediction"])
    labels = [str(a["prediction"]) for a in alone[:3]] + [wrong]  # three right, one wrong
    reply = client.post("/v1/classify/batch", files=files, data={"top_k": "2", "label": labels})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [r["prediction"] for r in body["results"]] == [a["prediction"] for a in alone]
    for got, want in zip(body["results"], alone, strict=True):
        assert [x["index"] for x in got["labels"]] == [x["index"] for x in want["labels"]]  # type: ignore[index]
    assert body["depth"] == 3 and [h["block"] for h in body["trace"]["hops"]] == [0, 1, 2]
    after = served(client)
    assert {a: after[a] - before[a] for a in after} == dict.fromkeys(after, 1)  # one call per hop, not four
    newest = client.get("/v1/swarm").json()["requests"][0]
    assert newest["batch"] == 4 and newest["labelled"] == 4 and newest["correct"] == 3


def test_json_batch_matches_multipart(client: httpx.Client) -> None:
    images = [png(seed) for seed in (7, 8)]
    items = [{"image_base64": base64.b64encode(image).decode(), "label": "a"} for image in images]
    reply = client.post("/v1/classify/batch", json={"images": items, "top_k": 1})
    assert reply.status_code == 200, reply.text
    assert [r["prediction"] for r in reply.json()["results"]] == [single(client, i)["prediction"] for i in images]


@pytest.mark.parametrize(
    ("kwargs", "status", "error"),
    [
        ({"files": [("file", ("a.png", png(0)))] * 65}, 413, "batch_too_large"),
        ({"json": {"images": [ONE] * 65}}, 413, "batch_too_large"),
        ({"files": [("file", ("a.png", png(0)))] * 2, "data": {"label": ["a"]}}, 422, "invalid_request"),
        ({"json": {"images": [], "top_k": 1}}, 422, "invalid_request"),
        ({"json": {"images": [{"image_base64": "@@"}]}}, 400, "invalid_base64"),
        ({"content": b"[" * 100_000, "headers": {"content-type": "application/json"}}, 400, "invalid_json"),
        ({"json": {"images": [ONE], "label": "a"}}, 422, "invalid_request"),
        ({"files": [("file", ("a.png", png(0))), ("file", ("b.png", b"not an image"))]}, 400, "invalid_image"),
        ({"content": b"x", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type"),
    ],
)  # fmt: skip
def test_batch_errors_are_json_4xx(client: httpx.Client, kwargs: dict[str, object], status: int, error: str) -> None:
    reply = client.post("/v1/classify/batch", **kwargs)  # type: ignore[arg-type]
    assert reply.status_code == status, reply.text
    assert reply.json()["error"] == error and reply.json()["detail"]
    if error == "invalid_image":
        assert "item 1" in reply.json()["detail"]  # which image of the batch is bad
    newest = client.get("/v1/swarm").json()["requests"][0]
    assert (newest["status"], newest["error"]) == (status, error)  # the page shows refused requests too
