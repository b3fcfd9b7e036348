"""Deferred verification (coordinator/deferred.py) on real in-process nodes (gRPC on loopback): a checked
hop's re-execution runs while the path goes on, the answer waits for every check, a failed check rewinds
the path to that hop, and blame never moves to an honest node downstream of a lie."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from prometheus_client import generate_latest
from safetensors.torch import load_file, save_file

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, Policy
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.models.checkpoint import block_file, rehash_model_dir
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb

from ..swarm import wait_until

if TYPE_CHECKING:
    from layerswarm.coordinator.verification.verifier import Screened

SEQ = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0)


def node(model_dir: Path, block: int, spec: FaultSpec | None = None) -> Node:
    settings = NodeSettings(model_dir=model_dir, block=block, advertise=False, grace_s=0.1)
    return Node(settings) if spec is None else FaultyNode(settings, spec)


def address(served: Node) -> str:
    return f"127.0.0.1:{served.port}"


@asynccontextmanager
async def swarm(
    model_dir: Path, served: list[Node], started: Callable[[], None] = lambda: None, **settings: object
) -> AsyncIterator[Coordinator]:
    """The nodes started (then `started()`: their servicers exist now), a coordinator once all are routable."""
    for n in served:
        await n.start()
    started()
    values: dict[str, object] = {"health_interval_s": 0.2, "hedge_quantile": None, "wire_dtype": "fp32", **settings}
    peers = tuple(address(n) for n in served)
    coord = Coordinator(CoordinatorSettings(model_dir=model_dir, peers=peers, mdns=False, **values))  # type: ignore[arg-type]
    await coord.start()
    try:
        await wait_until(lambda: all(r.routable for r in coord.registry.nodes.values()), what="every node routable")
        await wait_until(lambda: len(coord.registry.nodes) == len(served), what="every node admitted")
        yield coord
    finally:
        await coord.stop()
        for n in served:
            await n.stop()


def on_call(served: Node, before: object) -> None:
    """Run `before()` whenever `served` is called (before it computes)."""
    handle = served.service._handle

    async def called(request: pb.ForwardRequest) -> pb.ForwardResponse:
        before()  # type: ignore[operator]
        return await handle(request)

    served.service._handle = called  # type: ignore[method-assign]


async def test_a_liar_on_a_checked_hop_is_rewound_and_the_answer_is_the_honest_one(family_dirs: list[Path]) -> None:
    """The rogue (block 0 of the coordinator's own model, asked first) is on probation, so its hop is
    checked; the path goes on with its lie, the check fails, the hops after it are discarded and rerun
    from the honest substitute: the answer is the all-honest one, the liar is convicted on evidence."""
    liar = node(family_dirs[0], 0, FaultSpec("zeros"))
    honest = [node(family_dirs[1], b) for b in range(3)]
    async with swarm(family_dirs[0], [liar, *honest], family_dirs=(family_dirs[1],), verify_rate=0.0) as coord:
        x = torch.rand(2, 3, 16, 16)
        path = (first := await coord.router.classify(x, SEQ)).path
        assert [h.node for h in path.hops] == [address(n) for n in honest]
        assert path.hops[0].outcome == "substituted" and "verification failed" in path.hops[0].attempts[0].error
        assert [(h.block, h.node, h.outcome) for h in path.discarded] == [
            (1, address(honest[1]), "discarded"),  # ran on the liar's output: thrown away, rerun
            (2, address(honest[2]), "discarded"),
        ]
        record = coord.registry.nodes[address(liar)]
        assert record.state.value == "quarantined" and record.evidence[0]["check"] == "re-execution"
        assert coord.verifier is not None and coord.verifier.counters.rewinds == 1
        assert all(coord.registry.nodes[address(n)].failed == 0 for n in honest)  # nobody honest blamed
        again = await coord.router.classify(x, SEQ)  # the liar is out: the all-honest path
        assert [h.node for h in again.path.hops] == [h.node for h in path.hops] and not again.path.discarded
        torch.testing.assert_close(first.probs, again.probs, rtol=0, atol=0)
        scraped = generate_latest(coord.metrics.registry).decode()
        assert "layerswarm_verify_rewinds_total 1.0" in scraped
        assert 'layerswarm_hops_total{outcome="discarded"} 2.0' in scraped


@pytest.mark.parametrize("deferred", [True, False])
async def test_the_next_hop_starts_while_a_check_runs_unless_deferral_is_off(
    family_dirs: list[Path], deferred: bool
) -> None:
    """Hop 0's check waits until hop 1 is called (an Event, at most 2 s): deferred, hop 1 is called while
    the check runs and releases it; off, hop 1 is called only after the check ended (unreleased)."""
    served = [node(family_dirs[0], b) for b in range(3)]
    events: list[str] = []
    released = asyncio.Event()
    async with swarm(family_dirs[0], served, verify_rate=1.0, verify_probation=0, verify_deferred=deferred) as coord:
        verifier = coord.verifier
        assert verifier is not None
        confirm = verifier.confirm

        async def slow_confirm(hop: Screened) -> None:
            if hop.position == 0:
                events.append("check 0 started")
                try:
                    await asyncio.wait_for(released.wait(), 2.0)
                except asyncio.TimeoutError:  # not the builtin before Python 3.11
                    events.append("check 0 not released")
            await confirm(hop)
            if hop.position == 0:
                events.append("check 0 passed")

        verifier.confirm = slow_confirm  # type: ignore[method-assign]
        on_call(served[1], lambda: (events.append("hop 1 called"), released.set()))
        result = await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)
        assert [h.outcome for h in result.path.hops] == ["ok", "ok", "ok"]
        if deferred:
            assert events == ["check 0 started", "hop 1 called", "check 0 passed"]
            assert verifier.counters.deferred == 3
        else:
            assert events == ["check 0 started", "check 0 not released", "check 0 passed", "hop 1 called"]
            assert verifier.counters.deferred == 0
        assert verifier.counters.reexecuted == 3 and verifier.counters.rewinds == 0


NEAR_LIMIT = 32000.0  # under half the fp16 limit (32752): passes the hard range filter


def amplifying_copy(src: Path, dst: Path) -> Path:
    """`src` with block 1 adding 2000 to every value (its MLP's output bias): from a near-limit input
    (a lie) its honest output is past the hard bound; from real activations it stays far below."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / block_file(1)))
    tensors["mlp.fc2.bias"] = tensors["mlp.fc2.bias"] + 2000.0
    save_file(tensors, str(dst / block_file(1)), metadata={"format": "layerswarm.model"})
    rehash_model_dir(dst)
    return dst


def answering_near_the_limit(served: Node) -> None:
    handle = served.service._handle

    async def lying(request: pb.ForwardRequest) -> pb.ForwardResponse:
        reply = await handle(request)
        out = codec.decode(reply.activations)
        fake = codec.encode(torch.full(out.shape, NEAR_LIMIT), codec.torch_dtype(reply.activations.dtype))
        return pb.ForwardResponse(request_id=reply.request_id, activations=fake, compute_ms=reply.compute_ms)

    served.service._handle = lying  # type: ignore[method-assign]


async def test_an_honest_node_pushed_past_the_hard_bound_by_an_earlier_lie_is_not_blamed(
    family_dirs: list[Path], tmp_path: Path
) -> None:
    """The liar's reply passes the hard filter but the honest next node's output (from it) does not. Its
    check still pending, the coordinator waits for it before blaming anyone: the lie is found, the path
    rewinds to it, and the honest node is neither quarantined nor counted as failed."""
    own = amplifying_copy(family_dirs[0], tmp_path / "amplified")
    liar = node(own, 0, FaultSpec())
    downstream = node(own, 1)
    served = [liar, node(family_dirs[1], 0), downstream, node(own, 2)]
    near_limit = lambda: answering_near_the_limit(liar)  # noqa: E731
    async with swarm(
        own, served, near_limit, family_dirs=(family_dirs[1],), wire_dtype="fp16", verify_rate=0.0
    ) as coord:
        result = await coord.router.classify(torch.rand(1, 3, 16, 16), SEQ)
        assert [h.node for h in result.path.hops] == [address(n) for n in served[1:]]
        assert "verification failed" in result.path.hops[0].attempts[0].error
        (thrown,) = result.path.discarded
        assert thrown.outcome == "discarded" and thrown.node is None  # its reply was never used
        assert [a.node for a in thrown.attempts] == [address(downstream)]
        assert "reply out of range" in thrown.attempts[0].error and "not blamed" in thrown.attempts[0].error
        assert coord.registry.nodes[address(liar)].state.value == "quarantined"
        honest = coord.registry.nodes[address(downstream)]
        assert honest.state.value == "healthy" and honest.failed == 0 and not honest.evidence
        assert coord.verifier is not None and coord.verifier.counters.rewinds == 1
        assert [d["address"] for d in coord.verifier.counters.detections] == [address(liar)]
