"""grpc.health.v1 with the node's boot id on every Check reply (wire/discovery.py: BOOT_KEY).

A coordinator checks each node about once a second. A node restarted between two checks (Docker's
restart policy brings one back within a second or two) passes the next check as if nothing happened,
so without this the coordinator kept the old incarnation's identity: a stale boot id on its pages and,
with a swarm token, signatures the new boot refuses until a request failed on it."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from layerswarm.wire.discovery import BOOT_KEY


class BootHealthServicer(HealthServicer):  # type: ignore[misc]  # grpc_health ships no types
    def __init__(self, boot_id: str) -> None:
        super().__init__()
        self._boot = ((BOOT_KEY, boot_id),)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        context.set_trailing_metadata(self._boot)
        return await super().Check(request, context)
