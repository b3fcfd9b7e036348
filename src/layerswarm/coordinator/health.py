"""Liveness and identity: Info for who a node is, grpc.health.v1 for whether it serves.

mDNS is only a membership hint: a SIGKILLed node never says goodbye and its record lingers, so
ejection and re-admission come from here (and from request failures in the executor).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2

from layerswarm.wire.discovery import HEALTH_SERVICE
from layerswarm.wire.v1 import block_pb2 as pb

from .clients import ClientPool
from .periodic import Periodic
from .registry import NodeIdentity, NodeState, Registry

log = logging.getLogger(__name__)


def identity_from_info(info: pb.NodeInfo) -> NodeIdentity:
    return NodeIdentity(
        family_id=info.family_id,
        model_id=info.model_id,
        block=info.block_index,
        variant=info.variant,
        weights_sha256=info.weights_sha256,
        boot_id=info.boot_id,
        protocol_version=info.protocol_version,
        depth=info.depth,
        tokens=info.tokens,
        dim=info.dim,
        shuffle_robust=info.shuffle_robust,
        device=info.device,
    )


class HealthMonitor:
    def __init__(self, registry: Registry, pool: ClientPool, interval_s: float, timeout_s: float) -> None:
        self.registry = registry
        self.pool = pool
        self.timeout_s = timeout_s
        self._periodic = Periodic("health-monitor", interval_s, self.check_all)

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()

    async def check_all(self) -> None:
        records = [
            r
            for r in self.registry.nodes.values()
            if not (r.state is NodeState.IGNORED and r.identity is None and r.advert_family)
        ]
        await asyncio.gather(*(self.check(r.address) for r in records))
        for gone in self.pool.addresses() - self.registry.nodes.keys():  # left the swarm: close its channel
            await self.pool.drop(gone)

    async def check(self, address: str) -> None:
        client = self.pool.get(address)
        record = self.registry.nodes.get(address)
        if record is None:
            return
        try:
            if record.identity is None or record.state is not NodeState.HEALTHY:
                # Identity can change under one address (a restarted node): re-read it before re-admitting.
                info = await client.info(self.timeout_s)
                self.registry.admit(address, identity_from_info(info))
            reply = await client.health.Check(
                health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                self.registry.refuse(address, "refuses our swarm token (UNAUTHENTICATED)")
            else:
                self.registry.health_failed(address, f"health check: {exc.code().name}: {exc.details()}")
            return
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            self.registry.health_ok(address)
        else:
            self.registry.eject(address, "node reports NOT_SERVING (draining)")
