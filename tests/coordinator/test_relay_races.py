"""Nodes of a chain racing its steps on other nodes (node/outbox.py, the coordinator's collect by digest):
each attack here got an honest node failed or barred before (found by an attack review, 2026-11-24)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from layerswarm.coordinator import NodeClient
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.node.outbox import PER_REQUEST
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb

from ..relay_lab import SEQ, TOKEN, images, in_process_relay_swarm, last_step_forged, running_the_last_step_first


def _racing_then_stealing(node: FaultyNode, stolen: list[Any]) -> None:
    """Any node of a chain holds the chain and its MAC and the swarm token. On each chain it (1) runs
    the last step itself on the last node (a racer's result, which the coordinator's waiting Collect
    takes first), then (2) opens its own Collect for the request id on the last node (any token holder
    may), then goes on as an honest node. Takes remove what they take: its Collect takes the chain's
    own result the moment the last node keeps it, and the coordinator's re-collect by the signed digest
    finds nothing."""
    relay = node.relayer.relay
    stealing: list[asyncio.Future[None]] = []

    async def racing(request: pb.RelayRequest, handle: Any) -> Any:
        forged, client = last_step_forged(request)
        await client.info(2.0)
        await client.relay(forged, 2.0)
        await asyncio.sleep(0.05)  # the coordinator's waiting Collect has taken the racer's result

        async def steal() -> None:
            try:
                stolen.append(await client.collect(request.forward.request_id, 5.0))
            finally:
                await client.close()

        stealing.append(asyncio.ensure_future(steal()))  # held: a task nobody holds may be collected
        await asyncio.sleep(0.05)  # our Collect is waiting at the last node
        async for event in relay(request, handle):
            yield event

    node.relayer.relay = racing  # type: ignore[method-assign]


async def test_a_chain_node_taking_the_chains_result_first_cannot_get_the_last_node_failed(tmp_path: Path) -> None:
    """A take removed its result: the thief's Collect took the chain's own result as soon as it was kept,
    the coordinator's collect by the signed digest found nothing, and the honest last node was failed
    (ejected after two requests). Results now stay until they expire."""
    served, coord = await in_process_relay_swarm(tmp_path, [FaultSpec()] * 4, verify_rate=None, min_blocks=1)
    stolen: list[Any] = []
    try:
        reference = await coord.router.classify(images(), SEQ)
        assert [h.outcome for h in reference.path.hops] == ["relayed"] * 4
        _racing_then_stealing(served[1], stolen)
        for _ in range(2):
            await coord.router.classify(images(), SEQ)
        failed = [coord.registry.nodes[f"127.0.0.1:{n.port}"].failed for n in served]
        assert failed == [0, 0, 0, 0], (failed, len(stolen))
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


async def test_a_node_filling_the_last_nodes_runs_cannot_get_the_node_before_it_barred(tmp_path: Path) -> None:
    """The chain's own run at the last node is refused ALREADY_EXISTS; the honest node before it hands
    back. Before, the probe found the last node answering, the claim was contradicted, and after three
    the honest node only ended chains while the racer was never struck. Now such a hand-back disputes the
    two (never adjacent for a while), nobody barred or failed."""
    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec()] * 5, blocks=[0, 1, 2, 3, 3], verify_rate=None, min_blocks=1
    )
    addresses = [f"127.0.0.1:{n.port}" for n in served]
    try:
        reference = await coord.router.classify(images(), SEQ)
        assert [h.outcome for h in reference.path.hops] == ["relayed"] * 4
        running_the_last_step_first(served[0], times=PER_REQUEST)  # fills its runs: ALREADY_EXISTS next
        for _ in range(3):
            result = await coord.router.classify(images(), SEQ)
            await coord.handbacks.wait()
            assert result.path.depth == 4, (result.path.hops, result.path.handbacks)
        claims = coord.registry.claims
        penultimate = addresses[2]
        assert claims.may_forward(penultimate), claims.get(penultimate)
        assert claims.get(penultimate).disputed >= 1  # type: ignore[union-attr]
        assert all(coord.registry.nodes[a].failed == 0 for a in addresses)
    finally:
        await coord.stop()
        for node in served:
            await node.stop()


def _flooding_collects(node: FaultyNode, opened: list[Any]) -> None:
    """On each chain, open MAX_WAITING + 8 Collects for made-up request ids on the last node (any token
    holder may call Collect): before, each take made a slot and the chain's own, the oldest, was
    evicted; now they fill the waiting places, and the coordinator's own Collect may be refused (its
    collect by digest follows); then go on honestly."""
    from layerswarm.node.outbox import MAX_WAITING

    relay = node.relayer.relay

    async def flooding(request: pb.RelayRequest, handle: Any) -> Any:
        client = NodeClient(request.chain[-1].address, 64 * 1024 * 1024, security=SecuritySettings(token=TOKEN))
        await client.info(2.0)
        rid = request.forward.request_id
        calls = [asyncio.ensure_future(client.collect(f"{rid}-junk{i}", 3.0)) for i in range(MAX_WAITING + 8)]
        opened.append((client, calls))
        await asyncio.sleep(1.0)  # they reach the last node
        async for event in relay(request, handle):
            yield event

    node.relayer.relay = flooding  # type: ignore[method-assign]


async def test_collects_for_made_up_ids_cannot_push_the_chains_result_out(tmp_path: Path) -> None:
    """A take made a slot for any request id: enough of them evicted the chain's slot, the coordinator's
    Collect gave up, and the last two nodes, honest, were failed. Takes make no slots now, their waiting
    is bounded, and a failed Collect is followed by one by the signed digest."""
    served, coord = await in_process_relay_swarm(tmp_path, [FaultSpec()] * 4, verify_rate=None, min_blocks=1)
    opened: list[Any] = []
    try:
        reference = await coord.router.classify(images(), SEQ)
        assert [h.outcome for h in reference.path.hops] == ["relayed"] * 4
        _flooding_collects(served[1], opened)
        await coord.router.classify(images(), SEQ)
        failed = [coord.registry.nodes[f"127.0.0.1:{n.port}"].failed for n in served]
        assert failed == [0, 0, 0, 0], failed
    finally:
        for client, calls in opened:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await client.close()
        await coord.stop()
        for node in served:
            await node.stop()


async def test_honest_hand_backs_under_a_tight_deadline_are_never_discounted(tmp_path: Path) -> None:
    """The other side of the given-limits check: six slow honest nodes (250 ms a hop) under a request
    deadline too short for all of them hand back as the deadline runs out, some at its 1 ms floor, and
    no such hand-back may read as shortened limits."""
    from layerswarm.coordinator import DepthError

    served, coord = await in_process_relay_swarm(
        tmp_path, [FaultSpec(delay_ms=250.0)] * 6, blocks=[0, 1, 2, 3, 4, 5], verify_rate=None, min_blocks=1,
        request_timeout_s=0.9, hop_timeout_s=0.4,
    )  # fmt: skip
    handbacks = []
    try:
        for _ in range(2):
            try:
                result = await coord.router.classify(images(), SEQ)
            except DepthError:
                continue
            await coord.handbacks.wait()
            handbacks += result.path.handbacks
        assert handbacks, "the deadline never ran out: nothing was checked"
        assert not any("discounted" in h for h in handbacks), handbacks
        for node in served:
            tally = coord.registry.claims.get(f"127.0.0.1:{node.port}")
            assert tally is None or tally.disputed == 0, tally
    finally:
        await coord.stop()
        for node in served:
            await node.stop()
