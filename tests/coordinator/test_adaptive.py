"""Adaptive compute through real node and coordinator processes: exit rules over HTTP (checked against
the same model run locally, in the order the trace names), ensembles, repeated blocks, anytime answers
and their metrics."""

from __future__ import annotations

import functools
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from layerswarm.harness.procs import Proc, stop_all
from layerswarm.models.checkpoint import load_model
from layerswarm.models.exits import ExitPolicy, ExitRule, simulate
from layerswarm.models.vit import ViT

from ..swarm import coordinator_process, start_nodes

pytestmark = pytest.mark.slow


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, size=(16, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def swarm(family_dirs: list[Path]) -> Iterator[tuple[httpx.Client, Path]]:
    """One model's three blocks, one node each; fp32 on the wire so local and remote agree."""
    model_dir = family_dirs[0]
    nodes = start_nodes([(model_dir, b) for b in range(3)])
    coord = coordinator_process(model_dir, nodes, "--health-interval", "0.2", "--wire-dtype", "fp32")
    client = httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=30)
    try:
        yield client, model_dir
    finally:
        client.close()
        stop_all([coord, *nodes])


def classify(client: httpx.Client, seed: int, **fields: object) -> dict[str, object]:
    data = {"seed": str(seed), "policy": "shuffle", **{k: str(v).lower() for k, v in fields.items()}}
    reply = client.post("/v1/classify", files={"file": ("a.png", png(seed), "image/png")}, data=data)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


@functools.cache
def local_model(model_dir: Path) -> ViT:
    return load_model(model_dir)[0]


def local_prefix(model_dir: Path, image_seed: int, order: list[int]) -> torch.Tensor:
    """(1, hops, classes): the head after each block, in `order`, computed here."""
    model = local_model(model_dir)
    pixels = np.asarray(Image.open(io.BytesIO(png(image_seed))).convert("RGB"), dtype=np.float32) / 255.0
    with torch.inference_mode():
        x = model.stem(torch.from_numpy(pixels.transpose(2, 0, 1).copy())[None])
        steps = []
        for position, index in enumerate(order):
            x = model.blocks[index](x, position)
            steps.append(model.head(x))
    return torch.stack(steps, 1)


@pytest.mark.parametrize(
    ("rule", "threshold"),
    [
        ("confidence", 0.25),
        ("confidence", 0.27),
        ("confidence", 0.29),
        ("entropy", 1.0),
        ("entropy", 0.999),
        ("entropy", 0.995),
        ("patience", 1),
    ],
)
def test_each_rule_exits_where_the_rule_says(swarm: tuple[httpx.Client, Path], rule: str, threshold: float) -> None:
    """The live exit depth equals the rule simulated on the same blocks in the same order, for several
    images: a rule that stops exiting, exits early when it should not, or late, fails this."""
    client, model_dir = swarm
    exits = 0
    for seed in range(4):
        body = classify(client, seed, exit_rule=rule, exit_threshold=threshold)
        full = classify(client, seed, exit_rule="none")
        order = [h["block"] for h in full["trace"]["hops"]]  # type: ignore[index]
        depth, answer = simulate(local_prefix(model_dir, seed, order), ExitPolicy(ExitRule(rule), threshold), 1)
        assert [h["block"] for h in body["trace"]["hops"]] == order[: body["depth"]]  # type: ignore[index]
        assert body["depth"] == int(depth[0]), (seed, body["depth"], int(depth[0]))
        assert body["exited_early"] == (int(depth[0]) < 3)
        assert body["exit_rule"] == (rule if body["exited_early"] else None)
        assert body["labels"][0]["index"] == int(answer.argmax(-1)[0])  # type: ignore[index]  # the exit hop's answer
        exits += bool(body["exited_early"])
    if threshold in (0.25, 1.0):
        assert exits == 4  # max probability >= 1/classes and normalised entropy <= 1 always: exit at once


def test_invalid_exit_options_are_422(swarm: tuple[httpx.Client, Path]) -> None:
    client, _ = swarm
    for data in ({"exit_rule": "patience"}, {"exit_rule": "entropy", "exit_threshold": "2"}, {"exit_rule": "x"}):
        reply = client.post("/v1/classify", files={"file": ("a.png", png(0), "image/png")}, data=data)
        assert reply.status_code == 422 and reply.json()["error"] == "invalid_request", reply.text


def test_parallel_ensemble_runs_k_routes_and_averages(swarm: tuple[httpx.Client, Path]) -> None:
    client, _ = swarm
    body = classify(client, 3, ensemble=3, ensemble_mode="parallel", exit_rule="none")
    trace = body["trace"]["ensemble"]  # type: ignore[index]
    assert body["routes"] == 3 and len(trace["routes"]) == 3 and trace["failed"] == []
    assert body["blocks"] == 9 and len(trace["extra_route_hops"]) == 2
    orders = [[h["block"] for h in hops] for hops in [body["trace"]["hops"], *trace["extra_route_hops"]]]  # type: ignore[index]
    assert len({tuple(o) for o in orders}) > 1  # the routes took different orders


def test_adaptive_ensemble_adds_a_route_only_when_unsure(swarm: tuple[httpx.Client, Path]) -> None:
    """A random 4-class head is never 0.9 sure (the default threshold without a policy file)."""
    client, _ = swarm
    body = classify(client, 4, ensemble=2, exit_rule="none")
    assert body["routes"] == 2 and body["trace"]["ensemble"]["mode"] == "adaptive"  # type: ignore[index]


def test_metrics_count_blocks_exits_routes(swarm: tuple[httpx.Client, Path]) -> None:
    client, _ = swarm
    # Its own exit (entropy 1.0 always exits at once: normalised entropy <= 1) and ensemble: a labelled
    # counter has no sample before its first, and this passed only after the tests above made them.
    assert classify(client, 1, exit_rule="entropy", exit_threshold=1.0)["exited_early"]
    classify(client, 4, ensemble=2, exit_rule="none")
    text = client.get("/metrics").text
    assert 'layerswarm_exits_total{rule="entropy"}' in text
    assert "layerswarm_blocks_per_request_bucket" in text and 'layerswarm_ensemble_routes_total{outcome="ok"}' in text


def test_repeats_fill_a_thin_swarm_instead_of_failing(family_dirs: list[Path]) -> None:
    """Blocks 0 and 1 reachable, min depth 3: repeats run one of them again; without them, 503 naming
    block 2, before any node worked on it: a rule that fires at once does not make it an answer."""
    nodes = start_nodes([(family_dirs[0], b) for b in range(2)])
    coord: Proc | None = None
    try:
        coord = coordinator_process(family_dirs[0], nodes, "--health-interval", "0.2", "--min-blocks", "3")
        assert coord.ready["readiness"]["min_blocks"] == 3 and "--min-blocks" in coord.ready["readiness"]["rule"]
        with httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=30) as client:
            body = classify(client, 0, repeats=True, exit_rule="none")
            hops = body["trace"]["hops"]  # type: ignore[index]
            assert body["depth"] == 3 and sum(h["repeat"] for h in hops) == 1
            assert sorted({h["block"] for h in hops}) == [0, 1]
            for fields in ({"repeats": "false"}, {"repeats": "false", "exit_rule": "entropy", "exit_threshold": "1"}):
                reply = client.post("/v1/classify", files={"file": ("a.png", png(0), "image/png")}, data=fields)
                assert reply.status_code == 503 and reply.json()["error"] == "insufficient_depth", reply.text
                assert reply.json()["missing_blocks"] == [2] and "block indices [2]" in reply.json()["detail"]
            readyz = client.get("/readyz").json()  # repeats are off for this model: not ready, and why
            assert readyz["status"] == "not_ready" and "block indices [2]" in readyz["detail"], readyz
    finally:
        stop_all([c for c in (coord,) if c is not None] + nodes)


def test_an_exit_may_stop_below_the_readiness_minimum(swarm: tuple[httpx.Client, Path]) -> None:
    """Readiness (how many blocks must be reachable) is not the exit floor: with all three blocks up and a
    request's minimum of 3, a rule that fires at once answers after one block (it waited for 3 before)."""
    client, _ = swarm
    body = classify(client, 2, min_blocks=3, exit_rule="entropy", exit_threshold=1.0)
    assert body["depth"] == 1 and body["exited_early"] is True and body["exit_rule"] == "entropy"


def test_anytime_answers_before_a_late_hop(family_dirs: list[Path]) -> None:
    """Every hop takes >= 300 ms; a 700 ms budget fits one or two hops, never three: the answer comes
    with what ran, marked. A request that fails this test (503, or all three hops) lost anytime."""
    nodes = start_nodes([(family_dirs[0], b) for b in range(3)], faults=("--fault-delay-ms", "300"))
    coord: Proc | None = None
    try:
        coord = coordinator_process(family_dirs[0], nodes, "--health-interval", "0.2", "--hedge-quantile", "0")
        with httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=30) as client:
            assert classify(client, 9, exit_rule="none")["depth"] == 3  # warm: streams open, latencies known
            for seed in range(3):
                body = classify(client, seed, deadline_ms=700, exit_rule="none")
                assert body["anytime"] is True and body["trace"]["anytime"] is True  # type: ignore[index]
                assert 1 <= body["depth"] < 3  # type: ignore[operator]
            assert "layerswarm_anytime_answers_total 3.0" in client.get("/metrics").text
        coord.stop()
        # below the anytime floor the budget does not cut: the answer comes late, at full depth, unmarked
        coord = coordinator_process(
            family_dirs[0], nodes, "--health-interval", "0.2", "--hedge-quantile", "0", "--anytime-min-blocks", "3"
        )
        with httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=30) as client:
            assert classify(client, 9, exit_rule="none")["depth"] == 3
            late = classify(client, 0, deadline_ms=700, exit_rule="none")
            assert late["depth"] == 3 and late["anytime"] is False and late["elapsed_ms"] > 700  # type: ignore[operator]
    finally:
        stop_all([c for c in (coord,) if c is not None] + nodes)


@pytest.fixture(scope="module")
def member_swarm(family_dirs: list[Path]) -> Iterator[httpx.Client]:
    """Two members' blocks, one node each; the coordinator holds both (--family-dir); fp32 wire."""
    own, other = family_dirs[0], family_dirs[1]
    nodes = start_nodes([(d, b) for d in (own, other) for b in range(3)])
    coord = coordinator_process(
        own, nodes, "--health-interval", "0.2", "--wire-dtype", "fp32", "--family-dir", str(other), "--no-verify"
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=30)
    try:
        yield client
    finally:
        client.close()
        stop_all([coord, *nodes])


def test_an_ensemble_over_members_runs_each_members_stem_nodes_and_head(
    member_swarm: httpx.Client, family_dirs: list[Path]
) -> None:
    """Route 1 is member 1 end to end: its nodes, and the averaged answer is exactly member 0's and
    member 1's local logits averaged (a route that silently ran member 0 again fails this)."""
    ids = [load_model(d)[1].model_id for d in family_dirs[:2]]
    fields = {"ensemble": 2, "ensemble_mode": "parallel", "exit_rule": "none", "policy": "shuffle", "seed": 1}
    reply = member_swarm.post("/v1/classify", files={"file": ("a.png", png(5), "image/png")}, data=fields)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    trace = body["trace"]["ensemble"]
    assert [r["model_id"] for r in trace["routes"]] == ids
    assert {h["model_id"] for h in body["trace"]["hops"]} == {ids[0]}
    assert {h["model_id"] for h in trace["extra_route_hops"][0]} == {ids[1]}
    hops = [body["trace"]["hops"], trace["extra_route_hops"][0]]  # under shuffle, each member's own nodes
    orders = [[h["block"] for h in route] for route in hops]
    logits = [local_prefix(d, 5, order)[:, -1] for d, order in zip(family_dirs[:2], orders, strict=True)]
    expected = ((logits[0] + logits[1]) / 2).softmax(-1)[0]
    top = body["labels"][0]
    assert top["index"] == int(expected.argmax()) and top["probability"] == pytest.approx(
        float(expected.max()), abs=1e-4
    )


def test_an_ensemble_over_orders_stays_on_the_coordinators_own_model(
    member_swarm: httpx.Client, family_dirs: list[Path]
) -> None:
    own = load_model(family_dirs[0])[1].model_id
    fields = {"ensemble": 2, "ensemble_mode": "parallel", "exit_rule": "none", "ensemble_over": "orders"}
    reply = member_swarm.post("/v1/classify", files={"file": ("a.png", png(6), "image/png")}, data=fields)
    assert reply.status_code == 200, reply.text
    assert [r["model_id"] for r in reply.json()["trace"]["ensemble"]["routes"]] == [own, own]
