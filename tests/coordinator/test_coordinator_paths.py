"""Coordinator behaviours on real in-process nodes (gRPC on loopback): the busy answer (HTTP, and one
admission count for every API), readiness, the per-request deadline, unary transport, the `fastest`
policy, a lying node refused end to end, early exit at a threshold that is not trivially met, and the
idle-stream cap."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, Policy, create_app
from layerswarm.coordinator.membership.clients import MAX_IDLE_STREAMS, NodeClient
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.models.checkpoint import load_model
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

from ..swarm import wait_until

SEQ = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0)


@asynccontextmanager
async def nodes(*specs: tuple[Path, int, float]) -> AsyncIterator[list[Node]]:
    """(model dir, block, injected delay in ms) per node."""
    started = [
        FaultyNode(NodeSettings(model_dir=d, block=b, advertise=False, grace_s=0.1), FaultSpec(delay_ms=delay))
        for d, b, delay in specs
    ]
    for n in started:
        await n.start()
    try:
        yield started
    finally:
        for n in started:
            await n.stop()


@asynccontextmanager
async def coordinator(
    model_dir: Path, served: list[Node], depth: int, **settings: object
) -> AsyncIterator[Coordinator]:
    peers = tuple(f"127.0.0.1:{n.port}" for n in served)
    values: dict[str, object] = {"health_interval_s": 0.2, "hedge_quantile": None, "wire_dtype": "fp32", **settings}
    coord = Coordinator(CoordinatorSettings(model_dir=model_dir, peers=peers, mdns=False, **values))  # type: ignore[arg-type]
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == depth, what=f"{depth} blocks reachable")
        yield coord
    finally:
        await coord.stop()


def png_upload() -> dict[str, tuple[str, bytes, str]]:
    from layerswarm.harness.samples import png_bytes

    return {"file": ("x.png", png_bytes(torch.rand(3, 16, 16).numpy()), "image/png")}


@pytest.fixture
def images() -> Iterator[torch.Tensor]:
    yield torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))


async def test_past_the_limit_requests_get_429_busy(family_dirs: list[Path]) -> None:
    async with (
        nodes((family_dirs[0], 0, 600.0)) as served,
        coordinator(family_dirs[0], served, 1, max_concurrent_requests=1) as coord,
    ):
        transport = httpx.ASGITransport(app=create_app(coord))
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as client:
            replies = await asyncio.gather(*(client.post("/v1/classify", files=png_upload()) for _ in range(3)))
        assert sorted(r.status_code for r in replies) == [200, 429, 429]
        busy = next(r for r in replies if r.status_code == 429).json()
        assert busy["error"] == "busy" and "in flight" in busy["detail"]
        assert coord.admission.in_flight == 0  # every admitted request was let go


async def test_every_api_admits_through_one_count(family_dirs: list[Path], images: torch.Tensor) -> None:
    """One count of requests in flight, held by the process: with a /v1 request in flight at a limit of
    one, KServe v2 is refused 429 too (in its own format) and the refusal is drawn on the page once;
    /metrics and the swarm page show that same count (they showed two counters before), and nothing
    leaks."""
    async with (
        nodes((family_dirs[0], 0, 600.0)) as served,
        coordinator(family_dirs[0], served, 1, max_concurrent_requests=1) as coord,
    ):
        transport = httpx.ASGITransport(app=create_app(coord))
        infer = f"/v2/models/{coord.settings.model_dir.name}/infer"
        tensor = {"name": "images", "datatype": "FP32", "shape": list(images.shape), "data": images.flatten().tolist()}
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as client:
            first = asyncio.ensure_future(client.post("/v1/classify", files=png_upload()))
            await wait_until(lambda: coord.admission.in_flight == 1, what="the first request admitted")
            page = (await client.get("/v1/swarm")).json()["swarm"]["in_flight"]
            scraped = (await client.get("/metrics")).text
            busy = await client.post(infer, json={"inputs": [tensor]})
            assert (await first).status_code == 200
            totals = (await client.get("/v1/swarm")).json()["stats"]["totals"]
        assert busy.status_code == 429 and "in flight" in busy.json()["error"], busy.text
        assert page == 1 and "layerswarm_http_in_flight 1.0" in scraped
        assert coord.admission.in_flight == 0
        assert (totals["requests"], totals["errors"]) == (2, 1)  # the answer and the refusal, once each


async def test_readyz_is_503_with_the_reason_below_the_minimum_depth(family_dirs: list[Path]) -> None:
    async with (
        nodes((family_dirs[0], 0, 0.0)) as served,
        coordinator(family_dirs[0], served, 1, min_blocks=2) as coord,
    ):
        transport = httpx.ASGITransport(app=create_app(coord))
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as client:
            starting = await client.get("/readyz")  # nothing is ready before the first round is done
            assert starting.status_code == 503
            await coord.watch.wait_first_round(10.0)
            reply = await client.get("/readyz")
            assert reply.status_code == 503
            detail = "only 1 of 3 blocks reachable, minimum depth is 2: no node for block indices [1, 2]"
            assert reply.json() == {"status": "not_ready", "detail": detail}
            assert (await client.get("/healthz")).status_code == 200  # alive, just not ready
            # Where repeats are on by default (calibration showed they help), a request with the defaults
            # is answered, the path filled by running a block again: ready says the same (before: 503
            # while classify answered 200, so a load balancer took a serving coordinator out).
            coord.router.adaptive = dataclasses.replace(coord.router.adaptive, repeats=True)
            reply = await client.get("/readyz")
            assert reply.status_code == 200 and "run some again" in reply.json()["detail"], reply.text
            result = await coord.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL))
            assert result.path.depth == 2 and [h.repeat for h in result.path.hops] == [False, True]


async def test_the_request_deadline_cuts_a_slow_hop(family_dirs: list[Path], images: torch.Tensor) -> None:
    """The node answers within the hop timeout (2 s) but not within the request's 0.3 s: no answer waits
    past the request deadline, and the hop says why."""
    async with nodes((family_dirs[0], 0, 1000.0)) as served:
        async with coordinator(family_dirs[0], served, 1, request_timeout_s=0.3, hop_timeout_s=2.0) as coord:
            from layerswarm.coordinator import DepthError

            with pytest.raises(DepthError):
                await coord.router.classify(images, SEQ)
        async with coordinator(family_dirs[0], served, 1, request_timeout_s=10.0, hop_timeout_s=2.0) as patient:
            result = await patient.router.classify(images, SEQ)
            assert [h.outcome for h in result.path.hops] == ["ok"]


async def test_unary_transport_gives_the_stream_transport_answers(
    family_dirs: list[Path], images: torch.Tensor
) -> None:
    async with nodes(*((family_dirs[0], b, 0.0) for b in range(3))) as served:
        answers = {}
        for transport in ("stream", "unary"):
            async with coordinator(family_dirs[0], served, 3, transport=transport) as coord:
                client = coord.pool.get(f"127.0.0.1:{served[0].port}")
                assert client.transport == transport
                result = await coord.router.classify(images, SEQ)
                assert [h.block for h in result.path.hops] == [0, 1, 2]
                answers[transport] = result.probs
                streams_kept = len(client._idle)  # unary calls open no ForwardStream to keep
                assert streams_kept == (0 if transport == "unary" else 1), (transport, streams_kept)
        model, _ = load_model(family_dirs[0])
        with torch.inference_mode():
            local = model(images).softmax(-1)
        torch.testing.assert_close(answers["unary"], answers["stream"])
        torch.testing.assert_close(answers["unary"], local, atol=1e-5, rtol=1e-4)


async def test_fastest_policy_routes_around_a_slow_node(family_dirs: list[Path], images: torch.Tensor) -> None:
    async with (
        nodes((family_dirs[0], 0, 150.0), (family_dirs[1], 0, 0.0)) as (slow, fast),
        coordinator(family_dirs[0], [slow, fast], 1) as coord,
    ):
        fastest = ClassifyOptions(policy=Policy.FASTEST, seed=0)
        used = [(await coord.router.classify(images, fastest)).path.hops[0].node for _ in range(8)]
        assert f"127.0.0.1:{slow.port}" in used[:2] or coord.registry.nodes[f"127.0.0.1:{slow.port}"].ewma_ms is None
        assert used[-4:] == [f"127.0.0.1:{fast.port}"] * 4, used  # once both are measured, the fast one wins


async def test_a_node_lying_about_its_weights_is_refused_end_to_end(
    family_dirs: list[Path], images: torch.Tensor
) -> None:
    """A real node whose Info claims a member's model id with other weights (a forged block) is listed as
    ignored with the reason, and no request is routed to it."""
    async with nodes((family_dirs[1], 0, 0.0), (family_dirs[0], 0, 0.0)) as (liar, honest):
        manifest = liar.runtime.manifest
        forged_files = {**manifest.files, **{k: "0" * 64 for k in manifest.files if k.startswith("block_0")}}
        liar.runtime.manifest = dataclasses.replace(manifest, files=forged_files)
        async with coordinator(family_dirs[0], [liar, honest], 1, family_dirs=(family_dirs[1],)) as coord:
            liar_address = f"127.0.0.1:{liar.port}"
            await wait_until(lambda: coord.registry.nodes[liar_address].state.value == "ignored", what="refusal")
            record = coord.registry.nodes[liar_address]
            assert record.reason == "weights sha256 differs from the family manifest"
            hops = [(await coord.router.classify(images, ClassifyOptions(seed=s))).path.hops for s in range(4)]
            assert all(h.node == f"127.0.0.1:{honest.port}" for path in hops for h in path)


def growing_confidence_model(path: Path) -> Path:
    """A model whose confidence grows with every block, as a trained one's does (random weights' does not):
    each block adds the same direction to every token, and the head reads class 0 along it."""
    from layerswarm.models.checkpoint import Lineage, save_model

    from ..conftest import make_model_dir

    model, _ = load_model(make_model_dir(path.parent / "random", seed=1))
    direction = torch.zeros(model.cfg.dim)
    direction[:8] = 1.0
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.fc2.bias.copy_(direction * 0.3)
        model.head.classifier.weight.zero_()
        model.head.classifier.weight[0, :8] = 0.6
        model.head.classifier.bias.zero_()
    save_model(model, path, Lineage(source="scratch"), dataset={"spec": "shapes:64:32", "data_seed": 0})
    return path


async def test_early_exit_at_a_threshold_between_two_depths(tmp_path: Path, images: torch.Tensor) -> None:
    """The threshold lies between the confidence after one block and after two: the request must run
    exactly two blocks (not one, not all three); above the last block's confidence it runs all three."""
    model_dir = growing_confidence_model(tmp_path / "growing")
    model, _ = load_model(model_dir)
    x = images[:1]
    with torch.inference_mode():
        h, confidence = model.stem(x), []
        for block in model.blocks:
            h = block(h)
            confidence.append(float(model.head(h).softmax(-1).max()))
    assert confidence[0] < confidence[1] < confidence[2], confidence
    between, above = (confidence[0] + confidence[1]) / 2, (confidence[2] + 1) / 2
    async with (
        nodes(*((model_dir, b, 0.0) for b in range(3))) as served,
        coordinator(model_dir, served, 3) as coord,
    ):
        early = await coord.router.classify(
            x, ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0, exit_confidence=between)
        )
        assert early.path.exited_early and [hop.block for hop in early.path.hops] == [0, 1]
        assert float(early.probs.max()) >= between
        full = await coord.router.classify(x, ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0, exit_confidence=above))
        assert not full.path.exited_early and [hop.block for hop in full.path.hops] == [0, 1, 2]


async def test_idle_streams_are_capped_per_node(model_dir: Path) -> None:
    async with nodes((model_dir, 0, 50.0)) as (node,):
        client = NodeClient(f"127.0.0.1:{node.port}", 64 * 1024 * 1024)
        try:
            x = torch.rand(1, 5, 32)
            request = pb.ForwardRequest(request_id="t", activations=codec.encode(x), position=0)
            concurrent = MAX_IDLE_STREAMS + 4
            await asyncio.gather(*(client.forward(request, timeout=10) for _ in range(concurrent)))
            assert len(client._idle) == MAX_IDLE_STREAMS  # the other streams were closed, not kept
            await client.forward(request, timeout=10)  # a kept stream is reused and kept again
            assert len(client._idle) == MAX_IDLE_STREAMS
        finally:
            await client.close()


def _reporting_compute_ms(node: Node, compute_ms: float) -> None:
    """Make `node` answer every Forward honestly but for the compute time it reports."""
    handle = node.service._handle

    async def lying(request: pb.ForwardRequest) -> pb.ForwardResponse:
        reply = await handle(request)
        reply.compute_ms = compute_ms
        return reply

    node.service._handle = lying  # type: ignore[method-assign]


@pytest.mark.parametrize("compute_ms", [float("nan"), float("inf"), -1e300, 1e300])
async def test_a_node_reporting_an_impossible_compute_time_spoils_no_link_or_answer(
    family_dirs: list[Path], compute_ms: float
) -> None:
    """A star hop's link is measured as its round trip less the compute the node reports. A report that
    cannot be true (not finite, negative, longer than the round trip) is left out: before, one NaN made
    the link's estimate NaN for good (every --policy network plan through the node cost NaN), and a
    compute longer than the round trip made the link look free. The hop's activations were fine: the
    answers stand and the node stays healthy."""
    async with (
        nodes(*((family_dirs[0], b, 0.0) for b in range(3))) as served,
        coordinator(family_dirs[0], served, 3, default_policy="network", min_blocks=3) as coord,
    ):
        liar = f"127.0.0.1:{served[1].port}"
        transport = httpx.ASGITransport(app=create_app(coord))
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as client:
            assert (await client.post("/v1/classify", files=png_upload())).status_code == 200
            honest_per_mb = coord.registry.links.per_mb(liar, "coordinator")
            assert honest_per_mb is not None
            _reporting_compute_ms(served[1], compute_ms)
            for _ in range(3):
                reply = await client.post("/v1/classify", files=png_upload())
                assert reply.status_code == 200, reply.text
            assert (await client.get("/v1/nodes")).status_code == 200
        assert coord.registry.links.per_mb(liar, "coordinator") == honest_per_mb  # the lies never got in
        assert coord.registry.nodes[liar].state.value == "healthy"
