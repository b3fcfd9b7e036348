"""Node discovery: zeroconf's async browser for `_layerswarm._tcp.local.`, plus static peers.

A record adds a candidate (or marks it ignored when it advertises another family); a goodbye removes
it. Whether a candidate is routable is decided by the health monitor, never by mDNS alone.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from layerswarm.wire.discovery import SERVICE_TYPE, Advert

from .periodic import Periodic
from .registry import Registry

log = logging.getLogger(__name__)


class MdnsDiscovery:
    def __init__(self, registry: Registry, interfaces: tuple[str, ...] = ()) -> None:
        self.registry = registry
        self.interfaces = list(interfaces)
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._addresses: dict[str, str] = {}  # instance name -> HOST:PORT
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        kwargs = {"interfaces": self.interfaces} if self.interfaces else {}
        self._zc = AsyncZeroconf(ip_version=IPVersion.V4Only, **kwargs)  # type: ignore[arg-type]
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, [SERVICE_TYPE], handlers=[self._on_change])

    async def stop(self) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._zc is not None:
            await self._zc.async_close()

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            address = self._addresses.pop(name, None)
            if address is not None:
                log.info("mDNS goodbye from %s (%s)", name, address)
                self.registry.remove(address)
            return
        task = asyncio.ensure_future(self._resolve(service_type, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, service_type: str, name: str) -> None:
        assert self._zc is not None
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(self._zc.zeroconf, 3000):
            log.warning("could not resolve mDNS record %s", name)
            return
        addresses = info.parsed_addresses(IPVersion.V4Only)
        if not addresses or info.port is None:
            log.warning("mDNS record %s has no IPv4 address or port", name)
            return
        address = f"{addresses[0]}:{info.port}"
        try:
            advert = Advert.from_txt(dict(info.properties))
        except ValueError as exc:
            log.warning("ignoring mDNS record %s: %s", name, exc)
            return
        self._addresses[name] = address
        record = self.registry.add_candidate(address, "mdns", advert.family)
        log.info(
            "discovered %s at %s (family %s, block %d): %s",
            name,
            address,
            advert.family,
            advert.block,
            record.state.value,
        )


class DnsDiscovery:
    """Peers from DNS: every address a name resolves to (a Kubernetes headless service lists one A
    record per ready pod). Re-resolved periodically; addresses that vanish from DNS are forgotten."""

    def __init__(self, registry: Registry, targets: tuple[str, ...], interval_s: float = 5.0) -> None:
        self.registry = registry
        self.targets = [_split_target(t) for t in targets]
        self._known: set[str] = set()
        self._periodic = Periodic("dns-discovery", interval_s, self.resolve_all)

    async def start(self) -> None:
        await self.resolve_all()
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()

    async def resolve_all(self) -> None:
        loop = asyncio.get_running_loop()
        found: set[str] = set()
        for host, port in self.targets:
            try:
                infos = await loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                log.warning("DNS discovery: cannot resolve %s (%s)", host, exc)
                continue
            found |= {f"{info[4][0]}:{port}" for info in infos}
        for address in found - self._known:
            self.registry.add_candidate(address, "dns")
        for address in self._known - found:
            self.registry.remove(address)
        self._known = found


def _split_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--peer-dns {target!r}: expected NAME:PORT")
    return host, int(port)
