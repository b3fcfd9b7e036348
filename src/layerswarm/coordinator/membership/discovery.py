"""Node discovery: zeroconf's async browser for `_layerswarm._tcp.local.`, plus DNS peers.

Everything heard here is a hint (registry.py): a record makes the health monitor look at an address,
a goodbye makes it look again at once; neither admits, changes or removes a node by itself, since
anyone on the LAN can send both. Adverts are bounded: names wait in a bounded queue and are resolved
at a bounded rate (a token bucket), and the registry bounds unproven candidates in all and per host,
so a flood of adverts costs bounded memory and leaves health checks their time.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from layerswarm.wire.discovery import SERVICE_TYPE, Advert
from layerswarm.wire.periodic import Periodic

from .records import MDNS
from .registry import Registry

log = logging.getLogger(__name__)
MAX_QUEUED_NAMES = 128  # adverts waiting to be resolved; past this the oldest waiting one is dropped
MAX_KNOWN_NAMES = 1024  # instance names mapped to addresses
RESOLVE_RATE_PER_S = 50.0
RESOLVE_BURST = 100
MAX_CONCURRENT_RESOLVES = 8


def _no_op(address: str) -> None:
    return None


class TokenBucket:
    """`rate` per second on average, bursts up to `burst`; `wait()` sleeps until a token is free."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()

    def try_take(self) -> bool:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    async def wait(self) -> None:
        while not self.try_take():
            await asyncio.sleep((1 - self._tokens) / self.rate)


class MdnsDiscovery:
    def __init__(
        self,
        registry: Registry,
        interfaces: tuple[str, ...] = (),
        verify: Callable[[str], None] = _no_op,
        rate_per_s: float = RESOLVE_RATE_PER_S,
        burst: int = RESOLVE_BURST,
    ) -> None:
        self.registry = registry
        self.interfaces = list(interfaces)
        self.verify = verify  # look at this address now (new or lost hint): the health monitor's job
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._addresses: OrderedDict[str, str] = OrderedDict()  # instance name -> HOST:PORT
        self._queue: OrderedDict[str, None] = OrderedDict()  # names waiting to be resolved
        self._wake = asyncio.Event()
        self._bucket = TokenBucket(rate_per_s, burst)
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_RESOLVES)
        self._tasks: set[asyncio.Task[None]] = set()
        self.dropped = 0  # adverts dropped from a full queue or refused by the registry's bounds
        self.last_heard = time.monotonic()  # of the last advert or goodbye (startup waits for quiet)

    async def start(self) -> None:
        kwargs = {"interfaces": self.interfaces} if self.interfaces else {}
        self._zc = AsyncZeroconf(ip_version=IPVersion.V4Only, **kwargs)  # type: ignore[arg-type]
        self._spawn(self._resolver())
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, [SERVICE_TYPE], handlers=[self._on_change])

    async def stop(self) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._zc is not None:
            await self._zc.async_close()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("mDNS discovery task failed", exc_info=task.exception())

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        self.last_heard = time.monotonic()
        if state_change is ServiceStateChange.Removed:
            self._queue.pop(name, None)
            address = self._addresses.pop(name, None)
            if address is not None:
                log.info("mDNS goodbye for %r (%s): a hint only, verifying the node", name, address)
                self._forget_hint(name, address)
            return
        self._queue[name] = None
        self._queue.move_to_end(name)
        if len(self._queue) > MAX_QUEUED_NAMES:
            self._queue.popitem(last=False)
            self._count_drop("advert queue full")
        self._wake.set()

    def _forget_hint(self, name: str, address: str) -> None:
        self.registry.drop_hint(address, f"{MDNS}:{name}")
        self.verify(address)  # whatever the goodbye says, the node's own answer decides

    async def _resolver(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._bucket.wait()
                if not self._queue:
                    break
                name, _ = self._queue.popitem(last=False)
                await self._slots.acquire()
                self._spawn(self._resolve_in_slot(name))

    async def _resolve_in_slot(self, name: str) -> None:
        try:
            await self._resolve(SERVICE_TYPE, name)
        finally:
            self._slots.release()

    async def _resolve(self, service_type: str, name: str) -> None:
        """Names are logged with repr: an advert's name is anyone's bytes, newlines included."""
        assert self._zc is not None
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(self._zc.zeroconf, 3000):
            log.warning("could not resolve mDNS record %r", name)
            return
        addresses = info.parsed_addresses(IPVersion.V4Only)
        if not addresses or info.port is None:
            log.warning("mDNS record %r has no IPv4 address or port", name)
            return
        address = f"{addresses[0]}:{info.port}"
        try:
            advert = Advert.from_txt(dict(info.properties))
        except ValueError as exc:
            log.warning("ignoring mDNS record %r: %s", name, exc)
            return
        previous = self._addresses.pop(name, None)
        if previous is not None and previous != address:
            self._forget_hint(name, previous)
        record = self.registry.add_candidate(address, MDNS, advert.family, hint=f"{MDNS}:{name}")
        if record is None:
            self._count_drop("too many unproven mDNS candidates")
            return
        self._addresses[name] = address
        if len(self._addresses) > MAX_KNOWN_NAMES:
            old_name, old_address = self._addresses.popitem(last=False)
            self._forget_hint(old_name, old_address)
        log.info(
            "mDNS: %r at %s (advertises family %s, block %d): %s",
            name,
            address,
            advert.family,
            advert.block,
            record.state.value,
        )
        self.verify(address)

    def _count_drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:  # a flood must not flood the log too
            log.warning("mDNS adverts dropped (%s): %d so far", why, self.dropped)


class DnsDiscovery:
    """Peers from DNS: every address a name resolves to (a Kubernetes headless service lists one A
    record per ready pod). Re-resolved periodically; addresses that vanish from DNS are forgotten."""

    def __init__(
        self,
        registry: Registry,
        targets: tuple[str, ...],
        interval_s: float = 5.0,
        verify: Callable[[str], None] = _no_op,
    ) -> None:
        self.registry = registry
        self.verify = verify
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
            self.verify(address)
        for address in self._known - found:  # a hint gone: the node's own answer decides if it left
            if self.registry.drop_hint(address, "dns"):
                self.verify(address)
        self._known = found


def _split_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--peer-dns {target!r}: expected NAME:PORT")
    return host, int(port)
