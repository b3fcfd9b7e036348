"""The Open Inference Protocol (KServe v2) against a real coordinator and node processes, with
tritonclient (a standard client from PyPI) as the client; answers checked against the native API."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image
from tritonclient.utils import InferenceServerException

from layerswarm.training.data.datasets import decode_image

pytestmark = pytest.mark.slow

MODEL = "m0"  # the KServe model name is the coordinator's model directory name


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, size=(16, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def url(api_swarm: str) -> str:
    return api_swarm.removeprefix("http://")


@pytest.fixture
def client(url: str) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(url, network_timeout=30) as c:
        yield c


def native(url: str, image: bytes) -> list[float]:
    """Class probabilities from the native API, indexed by class."""
    reply = httpx.post(f"http://{url}/v1/classify", files={"file": ("a.png", image)}, data={"top_k": "4"}, timeout=30)
    assert reply.status_code == 200, reply.text
    probs = [0.0] * 4
    for label in reply.json()["labels"]:
        probs[label["index"]] = label["probability"]
    return probs


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL
    inputs = {t["name"]: t for t in meta["inputs"]}
    assert inputs["images"] == {"name": "images", "datatype": "FP32", "shape": [-1, 3, 16, 16]}
    assert inputs["images_encoded"]["datatype"] == "BYTES"
    outputs = {t["name"]: t for t in meta["outputs"]}
    assert outputs["probabilities"]["shape"] == [-1, 4] and outputs["class_ids"]["datatype"] == "INT64"
    assert httpx.get(f"http://{client._parsed_url.netloc}/v2/models").json()["models"][0]["name"] == MODEL


def test_fp32_batch_binary_matches_native_api(url: str, client: triton.InferenceServerClient) -> None:
    """tritonclient's defaults (binary tensors both ways); a batch of 3 gives each item its own answer,
    the same as the native API gives for that image alone."""
    images = [png(seed) for seed in range(3)]
    batch = np.stack([decode_image(image) for image in images]).astype(np.float32)
    tensor = triton.InferInput("images", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    result = client.infer(MODEL, [tensor])
    probs = result.as_numpy("probabilities")
    assert probs.shape == (3, 4) and np.allclose(probs.sum(-1), 1.0, atol=1e-5)
    for i, image in enumerate(images):
        assert np.allclose(probs[i], native(url, image), atol=1e-4)
    assert result.as_numpy("class_ids").tolist() == probs.argmax(-1).tolist()
    assert [b.decode() for b in result.as_numpy("labels")] == [("a", "b", "c", "d")[i] for i in probs.argmax(-1)]


def test_encoded_images_json_and_classification_extension(url: str, client: triton.InferenceServerClient) -> None:
    images = [png(seed) for seed in (5, 6)]
    tensor = triton.InferInput("images_encoded", [2], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_), binary_data=True)
    wanted = [
        triton.InferRequestedOutput("probabilities", binary_data=False),
        triton.InferRequestedOutput("labels", class_count=2),
    ]
    result = client.infer(MODEL, [tensor], outputs=wanted, request_id="r-1")
    assert result.get_response()["id"] == "r-1"
    probs = result.as_numpy("probabilities")
    assert np.allclose(probs[1], native(url, images[1]), atol=1e-4)
    top = result.as_numpy("labels")
    assert top.shape == (2, 2)
    score, index, label = top[0][0].decode().split(":")
    assert int(index) == int(probs[0].argmax()) and label == "abcd"[int(index)]
    assert abs(float(score) - float(probs[0].max())) < 1e-5


def test_one_call_per_hop_for_a_batch(url: str, client: triton.InferenceServerClient) -> None:
    """A batch of 5 runs as ONE batch per hop: every node serves one call more, not five."""

    def served() -> dict[str, int]:
        return {n["address"]: n["served"] for n in httpx.get(f"http://{url}/v1/nodes").json()["nodes"]}

    before = served()
    tensor = triton.InferInput("images", [5, 3, 16, 16], "FP32")
    tensor.set_data_from_numpy(np.random.default_rng(1).random((5, 3, 16, 16), dtype=np.float32))
    assert client.infer(MODEL, [tensor]).as_numpy("probabilities").shape == (5, 4)
    after = served()
    assert {a: after[a] - before[a] for a in after} == dict.fromkeys(after, 1)


def test_labels_feed_the_page_accuracy(url: str, client: triton.InferenceServerClient) -> None:
    image = png(9)
    truth = "abcd"[int(np.argmax(native(url, image)))]
    before = httpx.get(f"http://{url}/v1/swarm").json()["stats"]["totals"]
    tensors = [triton.InferInput("images_encoded", [2], "BYTES"), triton.InferInput("label", [2], "BYTES")]
    tensors[0].set_data_from_numpy(np.array([image, image], dtype=np.object_))
    wrong = next(c for c in "abcd" if c != truth)  # a class, just not this image's answer
    tensors[1].set_data_from_numpy(np.array([truth.encode(), wrong.encode()], dtype=np.object_))
    client.infer(MODEL, tensors)
    after = httpx.get(f"http://{url}/v1/swarm").json()
    totals = after["stats"]["totals"]
    assert totals["labelled"] - before["labelled"] == 2 and totals["correct"] - before["correct"] == 1
    newest = after["requests"][0]
    assert newest["api"] == "v2" and newest["batch"] == 2 and [s["block"] for s in newest["route"]] == [0, 1, 2]


def test_errors_are_protocol_json_4xx(url: str, client: triton.InferenceServerClient) -> None:
    tensor = triton.InferInput("images", [1, 3, 8, 8], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 8, 8), dtype=np.float32))
    with pytest.raises(InferenceServerException, match=r"must be FP32 of shape \[-1, 3, 16, 16\]"):
        client.infer(MODEL, [tensor])
    big = triton.InferInput("images", [65, 3, 16, 16], "FP32")
    big.set_data_from_numpy(np.zeros((65, 3, 16, 16), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="over the limit of 64"):
        client.infer(MODEL, [big])
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")
    base = f"http://{url}/v2/models/{MODEL}/infer"
    images = {"name": "images", "datatype": "FP32", "shape": [1, 3, 16, 16]}
    encoded = {"name": "images_encoded", "datatype": "BYTES", "shape": [1], "data": ["aGVsbG8="]}  # "hello"
    cases = [
        (b"not json", {}, 400),
        (b"[" * 100_000, {}, 400),  # nesting deeper than the JSON parser recurses
        (json.dumps({"inputs": []}).encode(), {}, 400),
        (json.dumps({"inputs": [{**images, "data": [1]}]}), {}, 400),  # 1 value for 768
        (json.dumps({"inputs": [{**images, "data": [[1.0] * 768], "datatype": "FP16"}]}), {}, 400),
        (json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}), {}, 400),
        (json.dumps({"inputs": [{**images, "parameters": {"binary_data_size": 10**9}}]}), {}, 400),
        (b"{}", {"Inference-Header-Content-Length": "x"}, 400),
        (b"{}", {"Inference-Header-Content-Length": "999"}, 400),
        (json.dumps({"inputs": [encoded]}), {}, 400),  # not an image
        (json.dumps({"inputs": [encoded], "parameters": {"polcy": "shuffle"}}), {}, 400),
        # Pixels outside [0, 1]: huge ones overflowed the stem into NaN, and every node refusing it was ejected.
        (json.dumps({"inputs": [{**images, "data": [1e30] * 768}]}), {}, 400),
        (json.dumps({"inputs": [{**images, "data": [1e6] * 768}]}), {}, 400),
        (json.dumps({"inputs": [{**images, "data": [255.0] * 768}]}), {}, 400),
        (json.dumps({"inputs": [{**images, "data": [-0.5] * 768}]}), {}, 400),
    ]
    for body, headers, status in cases:
        reply = httpx.post(base, content=body, headers=headers)
        assert reply.status_code == status, (body[:80], reply.text)
        assert isinstance(reply.json()["error"], str) and reply.json()["error"]
        newest = httpx.get(f"http://{url}/v1/swarm").json()["requests"][0]
        assert newest["api"] == "v2" and newest["status"] == status  # counted among the page's errors
    plain, split = (
        httpx.post(base, content=b"not json"),
        httpx.post(base, content=b"not json", headers={"Inference-Header-Content-Length": "8"}),
    )  # the error names the part that is not JSON: the whole body, or the binary extension's header
    assert plain.json()["error"].startswith("the request body: "), plain.text
    assert split.json()["error"].startswith("the JSON inference header: "), split.text
    assert httpx.post(f"http://{url}/v2/models/nope/infer", content=b"{}").status_code == 404
    nodes = httpx.get(f"http://{url}/v1/nodes").json()["nodes"]
    assert nodes and all(n["state"] == "healthy" for n in nodes)  # no refusal was counted against a node
