"""Shared by the relay tests: an in-process relay swarm of FaultyNodes (faults injected per node), and
the constants the real-process tests use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, NodeClient, Policy
from layerswarm.harness.faults import FaultSpec, FaultyNode
from layerswarm.node.settings import NodeSettings
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb

from .conftest import make_model_dir
from .swarm import wait_until

TOKEN = "relay-test-token"
DEPTH = 4
SEQ = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0, exit_rule="none")


def without_trace_key(node: FaultyNode) -> None:
    """Make `node` give no trace key in its Info (as a node from before trace keys, or one that would
    rather its trace entries went unchecked)."""
    make = node.make_service

    def make_service() -> Any:
        service = make()
        service.relayer.signer.public = b""
        return service

    node.make_service = make_service  # type: ignore[method-assign]


def without_relay_stream(node: FaultyNode) -> None:
    """Make `node` answer RelayStream as a node from before it did (UNIMPLEMENTED)."""
    make = node.make_service

    def make_service() -> Any:
        service = make()

        async def relay_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
            yield  # pragma: no cover - abort raises

        service.RelayStream = relay_stream  # type: ignore[method-assign]
        return service

    node.make_service = make_service  # type: ignore[method-assign]


def tampering_onward(node: FaultyNode, tamper: Callable[[pb.RelayRequest], None]) -> None:
    """Make `node` alter, with `tamper`, every chain request it forwards to its next node (fields
    outside its own hop), while it runs and waits as an honest node does itself."""
    pool = node.relayer.peers
    assert pool is not None
    get = pool.get

    async def get_tampering(address: str) -> Any:
        peer = await get(address)
        if not getattr(peer, "tampering", False):
            relay = peer.relay

            async def relay_tampered(request: pb.RelayRequest, timeout: float, stream: bool) -> Any:
                tamper(request)  # a fresh message per chain (node/relay.py: _forward)
                return await relay(request, timeout, stream)

            peer.relay = relay_tampered
            peer.tampering = True
        return peer

    pool.get = get_tampering  # type: ignore[method-assign]


def last_step_forged(request: pb.RelayRequest) -> tuple[pb.RelayRequest, NodeClient]:
    """The chain's last step as a node of the chain can forge it (its own input, at the last position;
    the chain's MAC is valid), and a client to the last node that holds the swarm token."""
    last = request.chain[-1]
    forged = pb.RelayRequest()
    forged.CopyFrom(request)
    forged.index, forged.forward.position = len(request.chain) - 1, last.position
    return forged, NodeClient(last.address, 64 * 1024 * 1024, security=SecuritySettings(token=TOKEN))


def running_the_last_step_first(node: FaultyNode, times: int) -> None:
    """Make `node`, on each chain, first run the chain's last step itself `times` times, directly on the
    last node, with an activation of its choosing (its own input, at the wrong position): a valid MAC,
    since it holds the chain, so the last node computes it. Then it goes on as an honest node."""
    relay = node.relayer.relay

    async def racing(request: pb.RelayRequest, handle: Any) -> Any:
        forged, client = last_step_forged(request)
        try:
            await client.info(2.0)  # the node's proof first: we call only nodes that proved the token
            for _ in range(times):
                await client.relay(forged, 2.0)
        finally:
            await client.close()
        async for event in relay(request, handle):
            yield event

    node.relayer.relay = racing  # type: ignore[method-assign]


async def in_process_relay_swarm(
    tmp_path: Path,
    faults: list[FaultSpec],
    node_values: dict[str, Any] | None = None,
    old_nodes: tuple[int, ...] = (),
    keyless: tuple[int, ...] = (),
    blocks: list[int] | None = None,  # the block of each node (default: node i serves block i)
    **settings: object,
) -> tuple[list[FaultyNode], Coordinator]:
    blocks = list(range(len(faults))) if blocks is None else blocks
    model = make_model_dir(tmp_path / "m", depth=max(blocks) + 1)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    security = SecuritySettings(token=TOKEN)
    served = [
        FaultyNode(
            NodeSettings(
                model_dir=model, block=b, advertise=False, security=security, **{"grace_s": 0.1, **(node_values or {})}
            ),
            spec,
        )
        for b, spec in zip(blocks, faults, strict=True)
    ]
    for b in old_nodes:
        without_relay_stream(served[b])
    for b in keyless:
        without_trace_key(served[b])
    for node in served:
        await node.start()
    values: dict[str, object] = {"health_interval_s": 60, "hedge_quantile": None, "wire_dtype": "fp32", **settings}
    peers = tuple(f"127.0.0.1:{n.port}" for n in served)
    coord = Coordinator(
        CoordinatorSettings(model_dir=model, peers=peers, mdns=False, topology="relay", token_file=token_file, **values)  # type: ignore[arg-type]
    )
    await coord.start()

    def all_routable() -> bool:
        return sum(r.routable for r in coord.registry.nodes.values()) == len(served)

    # Start-up, not what a test checks: a loaded CI machine has taken over 15 s to admit every node.
    await wait_until(all_routable, timeout=45.0, what="all nodes routable")
    return served, coord


def images() -> torch.Tensor:
    return torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
