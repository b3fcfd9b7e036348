"""mDNS (DNS-SD) announcement of a node, with the goodbye on shutdown."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable
from typing import Any

import ifaddr
from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from layerswarm.wire.discovery import SERVICE_TYPE, Advert, instance_name

log = logging.getLogger(__name__)


def routable_addresses(host: str) -> list[str]:
    """Addresses to put in the record: the bound host, or every IPv4 address when bound to all."""
    if host not in ("0.0.0.0", "", "::"):
        return [socket.gethostbyname(host)]
    found = [
        ip.ip
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if isinstance(ip.ip, str) and not ip.ip.startswith("127.")
    ]
    return found or ["127.0.0.1"]


class Advertiser:
    def __init__(
        self, advert: Advert, model_id: str, port: int, addresses: list[str], interfaces: tuple[str, ...] = ()
    ) -> None:
        self.info = ServiceInfo(
            SERVICE_TYPE,
            instance_name(model_id, advert.block, advert.boot),
            addresses=[socket.inet_aton(a) for a in addresses],
            port=port,
            properties=advert.to_txt(),
            server=f"layerswarm-{advert.boot[:12]}.local.",
        )
        self._interfaces = list(interfaces)
        self._zc: AsyncZeroconf | None = None
        self._announcing: Awaitable[Any] | None = None

    async def start(self) -> None:
        kwargs = {"interfaces": self._interfaces} if self._interfaces else {}
        self._zc = AsyncZeroconf(ip_version=IPVersion.V4Only, **kwargs)  # type: ignore[arg-type]
        # The returned task finishes the probe/announce broadcasts in the background; the node already
        # serves gRPC, so a browser that resolves us early finds a working server.
        self._announcing = await self._zc.async_register_service(self.info)
        log.info("advertised %s on %s", self.info.name, self.info.parsed_addresses())

    async def announced(self) -> None:
        """Wait until the probe and announce broadcasts are done (browsers have heard of us)."""
        if isinstance(self._announcing, asyncio.Future):
            await asyncio.shield(self._announcing)

    async def stop(self) -> None:
        """Send the goodbye (TTL 0) so browsers drop the node at once, then close the sockets."""
        if self._zc is None:
            return
        if isinstance(self._announcing, asyncio.Future) and not self._announcing.done():
            self._announcing.cancel()
        broadcast = await self._zc.async_unregister_service(self.info)
        await broadcast  # the goodbye packets are sent by this task: closing before it ends loses them
        await self._zc.async_close()
        self._zc = None
        log.info("sent mDNS goodbye for %s", self.info.name)
