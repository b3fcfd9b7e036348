"""A text family through the swarm: a node serves a text block exactly as locally (with and without a
token mask), padding changes nothing, frozen tokens are read but not computed, bad input is refused,
and the coordinator's /v1/classify/text answers as the local model does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from layerswarm.harness.procs import Proc, stop_all
from layerswarm.models.checkpoint import Lineage, load_block, load_model, save_model
from layerswarm.models.config import ViTConfig
from layerswarm.models.policy import write_entry
from layerswarm.models.text.depth import DEPTH_POLICY, token_depths
from layerswarm.models.text.model import TextEncoder
from layerswarm.models.text.tokenizer import CLS_ID, encode_batch, save_tokenizer, train_tokenizer
from layerswarm.models.text.tokens import (
    ACTIVE_CODE,
    FROZEN_CODE,
    PAD_CODE,
    join_states,
    run_active,
    split_states,
)
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.training.text.depth import depth_policy, mi_depths
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from ..swarm import coordinator_process, start_nodes

SENTENCES = ["red fish swims far", "blue bird sings", "red bird", "blue fish far away", "the red one"] * 4
LABELS = torch.tensor([0, 1, 0, 1, 0] * 4)


def make_text_dir(out: Path, seed: int = 0) -> Path:
    tok = train_tokenizer(SENTENCES)
    cfg = ViTConfig(kind="text", vocab_size=tok.get_vocab_size(), max_tokens=8, num_classes=2, dim=32, heads=2, depth=3)
    cfg = cfg.replace(variant="layershuffle", class_names=("red", "blue"))
    torch.manual_seed(seed)
    save_tokenizer(tok, out)
    save_model(TextEncoder(cfg), out, Lineage())
    ids = encode_batch(tok, SENTENCES, 8)
    mi = mi_depths(ids, LABELS, cfg.vocab_size, 2, bins=3)
    write_entry(out, DEPTH_POLICY, depth_policy(mi, [3] * cfg.vocab_size, 3))
    return out


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_text_dir(tmp_path_factory.mktemp("text") / "model")


@pytest.fixture
async def stub(text_dir: Path) -> AsyncIterator[pb_grpc.BlockNodeStub]:
    node = Node(NodeSettings(model_dir=text_dir, block=1, advertise=False, grace_s=0.5))
    await node.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
            yield pb_grpc.BlockNodeStub(channel)
    finally:
        await node.stop()


def request(x: torch.Tensor, mask: torch.Tensor | None = None, position: int = 0) -> pb.ForwardRequest:
    token_mask = None if mask is None else codec.encode(mask)
    return pb.ForwardRequest(request_id="t", activations=codec.encode(x), position=position, token_mask=token_mask)


def test_mi_depths_make_label_words_shallow(text_dir: Path) -> None:
    from layerswarm.models.checkpoint import read_manifest

    table = read_manifest(text_dir).policy[DEPTH_POLICY]["mi"]
    tok = train_tokenizer(SENTENCES)
    assert table[tok.token_to_id("red")] < table[tok.token_to_id("swims")]  # red decides the label
    ids = encode_batch(tok, ["red swims", "blue"], 8)
    depth = token_depths(read_manifest(text_dir).policy[DEPTH_POLICY], "mi", ids)
    assert depth[0, 0] == 3 and depth[1, 0] == 3 and depth[1, 3:].eq(0).all()  # [CLS]: full depth; pad: 0
    assert ids[0, 0] == CLS_ID


async def test_remote_text_block_equals_local(stub: pb_grpc.BlockNodeStub, text_dir: Path) -> None:
    local = load_block(text_dir, 1)
    x = torch.randn(2, 6, 32)
    reply = await stub.Forward(request(x, position=2))
    with torch.inference_mode():
        assert torch.equal(codec.decode(reply.activations), local(x, 2))
    mask = torch.tensor([[2, 1, 2, 2, 1, 0], [2, 2, 1, 0, 0, 0]], dtype=torch.float32)
    reply = await stub.Forward(request(x, mask, position=1))
    out = codec.decode(reply.activations)
    assert out.shape == (5, 32)  # only the active tokens come back
    assert torch.equal(out, run_active(local, x, 1, mask))


async def test_padding_and_frozen_tokens(stub: pb_grpc.BlockNodeStub, text_dir: Path) -> None:
    """Garbage in padded positions changes nothing; frozen tokens still count as keys and values."""
    x = torch.randn(1, 5, 32)
    mask = torch.tensor([[ACTIVE_CODE, FROZEN_CODE, ACTIVE_CODE, PAD_CODE, PAD_CODE]])
    first = codec.decode((await stub.Forward(request(x, mask))).activations)
    assert tuple(first.shape) == (2, 32)  # the reply carries the 2 active tokens only, not the frozen one
    noisy = x.clone()
    noisy[0, 3:] = torch.randn(2, 32) * 5
    second = codec.decode((await stub.Forward(request(noisy, mask))).activations)
    short = codec.decode((await stub.Forward(request(x[:, :3], mask[:, :3]))).activations)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(first, short, rtol=1e-5, atol=1e-6)
    all_active = torch.tensor([[ACTIVE_CODE, ACTIVE_CODE, ACTIVE_CODE, PAD_CODE, PAD_CODE]])
    full = codec.decode((await stub.Forward(request(x, all_active))).activations)
    torch.testing.assert_close(full[[0, 2]], first, rtol=1e-5, atol=1e-6)  # frozen token 1 read, not updated
    changed = x.clone()
    changed[0, 1] = torch.randn(32)  # a frozen token's state is a key/value: changing it changes active outputs
    third = codec.decode((await stub.Forward(request(changed, mask))).activations)
    assert not torch.allclose(first, third)


@pytest.mark.parametrize(
    ("make", "detail"),
    [
        (lambda: request(torch.randn(1, 9, 32)), "this family takes 8"),
        (lambda: request(torch.randn(1, 4, 32), torch.ones(1, 5)), "does not match activations"),
        (lambda: request(torch.randn(1, 4, 32), torch.full((1, 4), 3.0)), "must be 0 (padding)"),
        (lambda: request(torch.randn(1, 4, 32), torch.zeros(1, 4)), "no real token"),
        (lambda: request(torch.randn(1, 4, 16)), "expected 32"),
        # No tokens at all: the node answered an empty tensor, as if it had computed something.
        (lambda: request(torch.randn(1, 0, 32)), "dim 1 is 0"),
        (lambda: request(torch.randn(1, 0, 32), torch.ones(1, 0)), "dim 1 is 0"),
    ],
)
async def test_bad_text_hops_get_invalid_argument(stub: pb_grpc.BlockNodeStub, make, detail: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Forward(make())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and detail in (err.value.details() or "")


async def test_image_block_refuses_a_token_mask(model_dir: Path) -> None:
    node = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.5))
    await node.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.BlockNodeStub(channel).Forward(request(torch.randn(1, 5, 32), torch.ones(1, 5)))
        assert "image block" in (err.value.details() or "")
    finally:
        await node.stop()


@pytest.fixture(scope="module")
def text_swarm(text_dir: Path) -> Iterator[httpx.Client]:
    nodes: list[Proc] = start_nodes([(text_dir, b) for b in range(3)])
    try:
        coord = coordinator_process(text_dir, nodes, "--health-interval", "0.2", "--wire-dtype", "fp32")
    except BaseException:
        stop_all(nodes)  # a coordinator that cannot start must not leave its nodes behind
        raise
    client = httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=20)
    try:
        yield client
    finally:
        client.close()
        stop_all([coord, *nodes])


def test_classify_text_through_the_swarm(text_swarm: httpx.Client, text_dir: Path) -> None:
    reply = text_swarm.post("/v1/classify/text", json={"text": "red fish swims", "policy": "sequential", "top_k": 2})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    model, _ = load_model(text_dir)
    tok = train_tokenizer(SENTENCES)
    with torch.inference_mode():
        probs = model(encode_batch(tok, ["red fish swims"], 8)).softmax(-1)[0]
    got = {label["label"]: label["probability"] for label in body["labels"]}
    assert got == pytest.approx({"red": float(probs[0]), "blue": float(probs[1])}, abs=1e-5)
    hops = body["trace"]["hops"]
    assert body["depth"] == 3 and [h["tokens"] for h in hops] == [4, 4, 4] and all(h["wire_bytes"] for h in hops)
    mi_reply = text_swarm.post("/v1/classify/text", json={"text": "red fish swims", "token_depth": "mi", "seed": 1})
    assert mi_reply.status_code == 200, mi_reply.text
    mi = mi_reply.json()
    mi_hops = mi["trace"]["hops"]
    assert sum(h["tokens"] for h in mi_hops) < 12 and mi_hops[0]["tokens"] == 4  # words freeze as they finish


@pytest.mark.parametrize(
    ("path", "payload", "status", "error"),
    [
        ("/v1/classify/text", {"text": "   "}, 422, "empty_text"),
        ("/v1/classify/text", {"text": "red " * 8}, 413, "text_too_long"),
        ("/v1/classify/text", {"text": 5}, 422, "invalid_request"),
        ("/v1/classify/text", {"text": "red", "token_depth": "deep"}, 422, "invalid_request"),
        ("/v1/classify/text", {"text": "red", "nonsense": 1}, 422, "invalid_request"),
        ("/v1/classify", {"image_base64": "AAAA"}, 400, "wrong_family"),
        ("/v2/models/x/infer", {"inputs": []}, 400, "wrong_family"),
    ],
)
def test_bad_text_requests_get_json_4xx(
    text_swarm: httpx.Client, path: str, payload: dict[str, object], status: int, error: str
) -> None:
    reply = text_swarm.post(path, json=payload)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"] == error


@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data; boundary=x"])
def test_text_requests_must_be_json(text_swarm: httpx.Client, content_type: str) -> None:
    reply = text_swarm.post("/v1/classify/text", content=b'{"text": "red"}', headers={"content-type": content_type})
    assert reply.status_code == 415 and reply.json()["error"] == "unsupported_media_type"
    assert "application/json with `text`" in reply.json()["detail"]


async def test_text_hops_in_half_precision_and_int8(text_dir: Path) -> None:
    """The compact wire formats carry text hops too: the reply holds the active tokens only."""
    from layerswarm.coordinator.routing.hop_call import text_reply

    node = Node(NodeSettings(model_dir=text_dir, block=0, advertise=False, grace_s=0.5))
    await node.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
            stub = pb_grpc.BlockNodeStub(channel)
            x = torch.randn(1, 4, 32)
            mask = torch.tensor([[ACTIVE_CODE, FROZEN_CODE, ACTIVE_CODE, PAD_CODE]])
            exact = run_active(load_block(text_dir, 0), x, 0, mask)
            for dtype in (torch.float16, torch.int8):
                req = pb.ForwardRequest(
                    request_id="t",
                    activations=codec.encode(x, dtype),
                    position=0,
                    token_mask=codec.encode(mask),
                    reply_dtype=codec.wire_dtype(dtype),  # type: ignore[arg-type]
                )
                reply = await stub.Forward(req)
                out = text_reply(x, mask, reply.activations, dtype)
                assert torch.equal(out[0, [1, 3]], x[0, [1, 3]])  # frozen and padding untouched
                torch.testing.assert_close(out[0, [0, 2]], exact, rtol=0.05, atol=0.05)
    finally:
        await node.stop()


@pytest.mark.slow
def test_up_runs_the_text_family_with_kills() -> None:
    """`layerswarm up --family text`: the same demo with sentences, nodes killed mid-run."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "layerswarm", "up", "--family", "text", "--json", "--requests", "6"]
    cmd += ["--network", "loopback", "--nodes", "8", "--kill", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["requests"] == 12 and summary["succeeded"] == 12 and summary["nodes_killed"] == 2
    assert summary["accuracy"] > 0.5  # 12 classes: chance is 0.083


def split_request(x: torch.Tensor, mask: torch.Tensor, frozen_dtype: torch.dtype | None = None) -> pb.ForwardRequest:
    """The split form: active rows in fp32, frozen rows in `frozen_dtype` (fp32 when None)."""
    active, frozen = split_states(x, mask)
    return pb.ForwardRequest(
        request_id="t",
        activations=codec.encode(active),
        frozen=codec.encode(frozen, frozen_dtype),
        position=1,
        token_mask=codec.encode(mask),
    )


async def test_split_form_is_the_full_form_with_frozen_rows_apart(stub: pb_grpc.BlockNodeStub, text_dir: Path) -> None:
    """Frozen rows sent apart (any dtype) are placed back by the mask: fp32 gives the full form's
    reply bit for bit; int8 gives what the block computes on the int8-rounded keys and values."""
    x = torch.randn(2, 6, 32)
    mask = torch.tensor([[2, 1, 2, 2, 1, 0], [2, 1, 1, 0, 0, 0]], dtype=torch.float32)
    full = codec.decode((await stub.Forward(request(x, mask, position=1))).activations)
    split = codec.decode((await stub.Forward(split_request(x, mask))).activations)
    assert torch.equal(split, full)
    compact = codec.decode((await stub.Forward(split_request(x, mask, torch.int8))).activations)
    active, frozen = split_states(x, mask)
    sent = join_states(mask, active, codec.as_sent(frozen, torch.int8))
    assert torch.equal(compact, run_active(load_block(text_dir, 1), sent, 1, mask))
    assert not torch.equal(compact, full)  # the frozen rows really arrived rounded


def _with(req: pb.ForwardRequest, **changes: object) -> pb.ForwardRequest:
    out = pb.ForwardRequest()
    out.CopyFrom(req)
    for field, value in changes.items():
        if value is None:
            out.ClearField(field)
        else:
            getattr(out, field).CopyFrom(value)
    return out


@pytest.mark.parametrize(
    ("change", "detail"),
    [
        ({"token_mask": None}, "frozen needs a token_mask"),
        ({"frozen": codec.encode(torch.randn(3, 32))}, "2 frozen tokens, activations has 3 rows and frozen 3"),
        ({"activations": codec.encode(torch.randn(2, 32))}, "3 active and 2 frozen"),
        ({"frozen": codec.encode(torch.randn(2, 16))}, "frozen: dim 1 is 16, expected 32"),
        ({"frozen": codec.encode(torch.full((2, 32), float("nan")))}, "frozen: tensor has NaN"),
    ],
)
async def test_bad_split_hops_get_invalid_argument(
    stub: pb_grpc.BlockNodeStub, change: dict[str, object], detail: str
) -> None:
    x = torch.randn(1, 6, 32)
    mask = torch.tensor([[2, 1, 2, 2, 1, 0]], dtype=torch.float32)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Forward(_with(split_request(x, mask), **change))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and detail in (err.value.details() or ""), (
        err.value.details()
    )


async def test_frozen_tokens_travel_int8_verified_and_counted(text_dir: Path) -> None:
    """Per-token depth through real nodes, every hop re-executed by the verifier: frozen tokens travel
    as int8 apart from the active ones (fewer bytes than --frozen-dtype wire, as the trace counts
    them), no honest node is blamed, and the answer stays the local model's."""
    from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, Policy
    from layerswarm.harness.procs import node_address
    from layerswarm.models.checkpoint import read_manifest
    from layerswarm.training.text.depth_eval import run_with_depths

    tok = train_tokenizer(SENTENCES)
    ids = encode_batch(tok, ["red fish swims far away"], 8)
    ids = ids[:, : int((ids != 0).sum())]
    depth = token_depths(read_manifest(text_dir).policy[DEPTH_POLICY], "mi", ids)
    assert depth.min() < depth.max()  # some tokens freeze early: the split form is used
    local, _ = load_model(text_dir)
    expected = run_with_depths(local, ids, list(local.blocks), depth)[0].softmax(-1)
    results = {}
    nodes = start_nodes([(text_dir, b) for b in range(3)])
    try:
        for frozen in ("int8", "wire"):
            settings = CoordinatorSettings(
                model_dir=text_dir,
                peers=tuple(node_address(n) for n in nodes),
                mdns=False,
                wire_dtype="fp32",
                frozen_dtype=frozen,
                verify_rate=1.0,
            )
            coord = Coordinator(settings)
            await coord.start()
            try:
                await coord.watch.wait_first_round(10.0)
                opts = ClassifyOptions(policy=Policy.SEQUENTIAL, token_depth=depth, min_blocks=3, max_blocks=3)
                result = await coord.router.classify(ids, opts)
                assert coord.verifier is not None and coord.verifier.counters.detections == []
                assert all(r.routable for r in coord.registry.nodes.values())
                results[frozen] = result
            finally:
                await coord.stop()
    finally:
        stop_all(nodes)
    int8_bytes = sum(h.wire_bytes or 0 for h in results["int8"].path.hops)
    wire_bytes = sum(h.wire_bytes or 0 for h in results["wire"].path.hops)
    assert int8_bytes < wire_bytes
    torch.testing.assert_close(results["wire"].probs, expected, rtol=1e-5, atol=1e-6)  # fp32, unsplit: exact
    torch.testing.assert_close(results["int8"].probs, expected, rtol=0.02, atol=0.02)
