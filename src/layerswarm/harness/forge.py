"""Forgeries for attack tests and chaos runs: what a stranger on the LAN can send without any key.

`MdnsAttacker` sends raw mDNS answers (adverts, and goodbyes with TTL 0) for any name and address,
from a real zeroconf socket; use it only inside a private network namespace (harness/netns.py).
`RecordingImpostor` is a BlockNode that poses as a real node (its identity, its challenge, a proof it
gave for another nonce) and records every call's metadata, to replay it elsewhere.
"""

from __future__ import annotations

import socket
from typing import Any

import grpc
from zeroconf import IPVersion, ServiceInfo, const
from zeroconf._protocol.outgoing import DNSOutgoing  # the public name is not re-exported for mypy
from zeroconf.asyncio import AsyncZeroconf

from layerswarm.wire.discovery import PROTOCOL_VERSION, SERVICE_TYPE, Advert
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc


class MdnsAttacker:
    """Raw mDNS answers from a real zeroconf socket: adverts and goodbyes (TTL 0) for any name and
    address, as anyone on the LAN can send them (no probing, no ownership)."""

    def __init__(self) -> None:
        self.azc = AsyncZeroconf(ip_version=IPVersion.V4Only)

    @staticmethod
    def info(name: str, host: str, port: int, family: str, block: int = 0) -> ServiceInfo:
        advert = Advert(family, "mdl-forged", block, "layershuffle", PROTOCOL_VERSION, "f" * 32, "0" * 16)
        return ServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}" if not name.endswith(SERVICE_TYPE) else name,
            addresses=[socket.inet_aton(host)],
            port=port,
            properties=advert.to_txt(),
            server=f"{name.split('.', maxsplit=1)[0]}.local.",
        )

    def send(self, infos: list[ServiceInfo], ttl: int | None, per_packet: int = 8) -> None:
        for start in range(0, len(infos), per_packet):
            out = DNSOutgoing(const._FLAGS_QR_RESPONSE | const._FLAGS_AA)
            for info in infos[start : start + per_packet]:
                records = [info.dns_pointer(ttl), info.dns_service(ttl), info.dns_text(ttl)]
                for record in [*records, *info.dns_addresses(ttl, IPVersion.V4Only)]:
                    out.add_answer_at_time(record, 0)
            self.azc.zeroconf.async_send(out)

    async def close(self) -> None:
        await self.azc.async_close()


class RecordingImpostor(pb_grpc.BlockNodeServicer):
    """A fake node without the token: it poses as the real node (its identity, its challenge, even a
    proof the real node gave for another nonce) and records everything the coordinator sends it."""

    def __init__(self, real: pb.NodeInfo, real_trailing: tuple[tuple[str, str], ...]) -> None:
        self.real, self.real_trailing = real, real_trailing
        self.received: list[tuple[str, tuple[tuple[str, str], ...]]] = []

    def _record(self, method: str, context: grpc.aio.ServicerContext) -> None:
        metadata = tuple((k, v if isinstance(v, str) else v.decode()) for k, v in context.invocation_metadata() or ())
        self.received.append((method, metadata))

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        self._record("Info", context)
        context.set_trailing_metadata(self.real_trailing)
        return self.real

    async def Forward(self, request: pb.ForwardRequest, context: grpc.aio.ServicerContext) -> pb.ForwardResponse:
        self._record("Forward", context)
        return pb.ForwardResponse(request_id=request.request_id, activations=request.activations)

    async def ForwardStream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        self._record("ForwardStream", context)
        async for request in request_iterator:
            yield pb.ForwardResponse(request_id=request.request_id, activations=request.activations)
