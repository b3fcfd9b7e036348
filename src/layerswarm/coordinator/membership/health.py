"""Liveness and identity: Info for who a node is (proved, with a swarm token), grpc.health.v1 for
whether it serves.

mDNS is only a membership hint: a SIGKILLed node never says goodbye and its record lingers, and a
goodbye may be forged, so ejection, re-admission and leaving all come from here (and from request
failures in the executor). A lost hint only makes the node be verified at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from layerswarm.wire.discovery import HEALTH_SERVICE
from layerswarm.wire.periodic import Periodic
from layerswarm.wire.v1 import block_pb2 as pb

from .clients import ClientPool, NodeClient, NodeNotProven
from .linkmap import COORDINATOR
from .records import NodeIdentity, NodeState, StreamLimits
from .registry import Registry

log = logging.getLogger(__name__)
REMEMBERED = "remembered"  # the hint a peer state file gives (watch.py)
REMEMBERED_TRIES = 5  # failed checks before an address only remembered from an earlier run is forgotten


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
        trace_key=info.trace_key,
        stream_limits=stream_limits_from_info(info),
    )


def stream_limits_from_info(info: pb.NodeInfo) -> StreamLimits | None:
    """A decoder node's limits; None for a classifier's block (which leaves the field unset)."""
    limits = info.stream_limits
    if limits.max_streams <= 0:
        return None
    return StreamLimits(limits.max_streams, limits.max_seq_len, limits.max_cache_bytes, limits.idle_timeout_s)


class HealthMonitor:
    def __init__(self, registry: Registry, pool: ClientPool, interval_s: float, timeout_s: float) -> None:
        self.registry = registry
        self.pool = pool
        self.timeout_s = timeout_s
        self._periodic = Periodic("health-monitor", interval_s, self.check_all)
        self._verifying: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
        for task in list(self._verifying.values()):
            task.cancel()
        await asyncio.gather(*self._verifying.values(), return_exceptions=True)

    def verify_soon(self, address: str) -> None:
        """Check one node now, outside the round (a new hint, a lost hint); at most one at a time each."""
        if address in self._verifying or address not in self.registry.nodes:
            return
        task = asyncio.create_task(self.check(address), name=f"verify {address}")
        self._verifying[address] = task
        task.add_done_callback(lambda t, a=address: self._verified(a, t))  # type: ignore[misc]

    def _verified(self, address: str, task: asyncio.Task[None]) -> None:
        self._verifying.pop(address, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("verifying %s failed", address, exc_info=task.exception())

    async def check_all(self) -> None:
        # Each node alone: an error checking one (a stranger's odd reply) must neither stop the others'
        # checks nor, in the first round that Coordinator.start awaits, the coordinator itself.
        addresses = list(self.registry.nodes)
        outcomes = await asyncio.gather(*(self.check(address) for address in addresses), return_exceptions=True)
        for address, outcome in zip(addresses, outcomes, strict=True):
            if isinstance(outcome, Exception):
                log.error("checking %s failed", address, exc_info=outcome)
        for gone in self.pool.addresses() - self.registry.nodes.keys():  # left the swarm: close its channel
            await self.pool.drop(gone)

    async def check(self, address: str) -> None:
        record = self.registry.nodes.get(address)
        if record is None:
            return
        if record.state is NodeState.IGNORED and not record.worth_contacting(self.registry.family.family_id):
            return  # every hint says it is a stranger: leave it be
        answered = await self._check(address)
        record.checked = True
        if not answered and set(record.hints) == {REMEMBERED} and record.consecutive_failures >= REMEMBERED_TRIES:
            # Only an earlier run's memory says a node was here: without this, a peer gone for good
            # (another LAN, a retired device) would be checked forever and listed as pending.
            self.registry.drop_hint(address, REMEMBERED)
        if not answered and not record.hints:  # no hint left and no answer of its own: it left
            self.registry.forget(address, "no longer advertised or listed, and not answering")
            await self.pool.drop(address)

    async def _check(self, address: str) -> bool:
        """Returns whether the node answered as a serving member."""
        client = self.pool.get(address)
        record = self.registry.nodes[address]
        try:
            if record.identity is None or record.state is not NodeState.HEALTHY or client.needs_proof:
                # Identity can change under one address (a restarted node): re-read it before re-admitting.
                await self._identify(address, client)
            started = time.monotonic()
            reply = await client.check_health(HEALTH_SERVICE, self.timeout_s)
            self.registry.links.observe_rtt(COORDINATOR, address, (time.monotonic() - started) * 1e3)
            if reply.boot_id and record.identity is not None and reply.boot_id != record.identity.boot_id:
                # Restarted between two checks (never ejected): who answers now proves itself again.
                log.info("%s answers with a new boot id: reading its identity again", address)
                client.forget_proof()
                await self._identify(address, client)
        except NodeNotProven as exc:
            self.registry.refuse(address, f"swarm authentication: {exc}")
            return False
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                self.registry.refuse(address, f"refuses our swarm credentials: {exc.details()}")
            else:
                self.registry.health_failed(address, f"health check: {exc.code().name}: {exc.details()}")
            return False
        if reply.serving:
            self.registry.health_ok(address)
            return record.state is not NodeState.IGNORED
        self.registry.eject(address, "node reports NOT_SERVING (draining)")
        return False

    async def _identify(self, address: str, client: NodeClient) -> None:
        info = await client.info(self.timeout_s)
        self.registry.admit(address, identity_from_info(info))
