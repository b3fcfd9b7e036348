"""mDNS (DNS-SD) announcement of a node, with the goodbye on shutdown."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import ifaddr
from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from layerswarm.wire.discovery import SERVICE_TYPE, Advert, instance_name

log = logging.getLogger(__name__)


# Where the kernel would send from: a UDP socket's connect() only looks the route up, nothing is sent.
# TEST-NET-3 is never routed on a real LAN, so only a default route leads to it; the mDNS group's route
# is the one mDNS itself takes (a LAN without a gateway has one, or the multicast route to it).
DEFAULT_ROUTE_PROBE = "203.0.113.1"
MDNS_GROUP = "224.0.0.251"


@dataclass(frozen=True)
class Advertised:
    """The addresses a node puts in its mDNS record, and the rule that chose them (logged at start)."""

    addresses: list[str]
    rule: str


def advertised_addresses(host: str, advertise_address: str | None = None) -> Advertised:
    """One rule: the address given (`--advertise-address`: an IPv4 address or an interface's name), else
    the bound host, else (bound to all) the source address of the route toward the LAN: the default
    route's, else the mDNS group's. A peer dials the first address of a record, so advertising every
    interface (docker0, a VPN, a Jetson's l4tbr0 listed before the LAN) made nodes unreachable. Only with
    no route at all does it fall back to every non-loopback IPv4 address. ValueError names a bad flag."""
    if advertise_address:
        return _given(advertise_address)
    if host not in ("0.0.0.0", "", "::"):
        return Advertised([socket.gethostbyname(host)], f"the bound host (--host {host})")
    for target, rule in ((DEFAULT_ROUTE_PROBE, "default route"), (MDNS_GROUP, f"route to mDNS group {MDNS_GROUP}")):
        source = route_source(target)
        if source is not None and not source.startswith("127."):
            return Advertised([source], f"the source address of the {rule}")
    found = [a for _, a in interface_addresses() if not a.startswith("127.")]
    if not found:
        return Advertised(["127.0.0.1"], "no route toward a LAN and no other address: loopback")
    return Advertised(found, "no route toward a LAN: every non-loopback IPv4 address")


def route_source(target: str) -> str | None:
    """The source address the kernel picks toward `target`, None without a route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, 9))
        except OSError:
            return None
        source: str = probe.getsockname()[0]
    return None if source == "0.0.0.0" else source


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of every interface, in the system's order."""
    return [(a.nice_name, ip.ip) for a in ifaddr.get_adapters() for ip in a.ips if isinstance(ip.ip, str)]


def _given(value: str) -> Advertised:
    try:
        socket.inet_aton(value)
    except OSError:
        pass
    else:
        if value.count(".") == 3:  # inet_aton also takes "10" and "10.1": a typo, not an address
            return Advertised([value], "--advertise-address")
    on_interface = [a for name, a in interface_addresses() if name == value]
    if not on_interface:
        names = sorted({name for name, _ in interface_addresses()})
        raise ValueError(
            f"--advertise-address {value}: neither an IPv4 address nor an interface with one "
            f"(interfaces: {', '.join(names)})"
        )
    return Advertised(on_interface[:1], f"--advertise-address {value} (that interface's first IPv4 address)")


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
