"""One gRPC channel per node address, with keepalive so a dead peer is noticed without traffic."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),  # the coordinator decides what to retry, and where
]


class NodeClient:
    def __init__(self, address: str, max_message_bytes: int) -> None:
        options = [
            *KEEPALIVE_OPTIONS,
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=options)
        self.block = pb_grpc.BlockNodeStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)


class ClientPool:
    def __init__(self, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_message_bytes = max_message_bytes
        self._clients: dict[str, NodeClient] = {}

    def get(self, address: str) -> NodeClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = NodeClient(address, self.max_message_bytes)
        return client

    async def drop(self, address: str) -> None:
        client = self._clients.pop(address, None)
        if client is not None:
            await client.channel.close()

    async def close(self) -> None:
        for address in list(self._clients):
            await self.drop(address)
