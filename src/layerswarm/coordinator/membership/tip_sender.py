"""Sends this coordinator's convictions to the other coordinators as tips (tips.py says what a tip is).

Every replica is told: a `--coordinator-peer` URL names one coordinator, or a service whose name
resolves to several (a Swarm stack's dnsrr service, a Kubernetes headless Service). Its name is
resolved when a tip is sent (getaddrinfo: every A and AAAA record, so replicas that came and went since
are current) and the tip goes to each address but our own. An https peer is sent to by name (its
certificate names the service, not each address): one replica of it hears.

Best effort, never in a request's way: each tip goes to each address in a task of its own, retried with
backoff on connection errors and 5xx (tenacity), then given up with a warning; a peer that refuses it
(4xx) is logged at once. Tasks are tracked and cancelled at stop; none dies silently.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from .tips import MAC_HEADER, Tip, new_tip, sign

log = logging.getLogger(__name__)
ATTEMPTS = 4  # per address and tip (and per name resolution): about 3.5 s of backoff in all
TIMEOUT_S = 2.0
WILDCARDS = ("", "0.0.0.0", "::")  # a bind address that listens on every local address

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> its addresses now


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` has now, each A and AAAA record once, in the resolver's order (an address
    literal is itself). Raises OSError (socket.gaierror) when it has none."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_local(address: str) -> bool:
    """Whether `address` is one of this host's (network namespace's) own: only those can be bound.
    Binding sends nothing."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL):
                return False
            raise
    return True


def is_self(address: str, port: int, own: tuple[set[str], int]) -> bool:
    """Whether `address`:`port` is this coordinator: our port, and our bind address (or, bound to every
    address, one of this host's)."""
    own_addresses, own_port = own
    if port != own_port:
        return False
    if own_addresses & set(WILDCARDS):
        return is_local(address)
    return address in own_addresses


def address_url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}"


class PeerDown(Exception):
    """A peer coordinator did not take the tip (connection error, 5xx, its name unresolved): worth
    another try."""


class TipSender:
    def __init__(
        self,
        peers: tuple[str, ...],
        key: bytes,
        own_host: str,
        own_port: int,
        resolver: Resolver = resolve,
    ) -> None:
        self.peers = tuple(p.rstrip("/") for p in peers)
        self.key = key
        self.own_host, self.own_port = own_host, own_port
        self.sender = address_url("http", own_host, own_port) if _is_ip(own_host) else f"http://{own_host}:{own_port}"
        self.resolver = resolver
        self.sent = 0  # deliveries a coordinator took (2xx), one per address
        self.failed = 0  # deliveries given up on or refused, names that never resolved
        self._client = httpx.AsyncClient(timeout=TIMEOUT_S)
        self._tasks: set[asyncio.Task[None]] = set()

    def convicted(self, address: str, boot_id: str, reason: str) -> None:
        """Tell every peer, each replica behind a name; returns at once."""
        tip = new_tip(address, boot_id, reason, self.sender, time.time())
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a conviction outside the event loop (never expected): said, not sent
            log.error("tip about %s not sent: no running event loop", address)
            return
        for peer in self.peers:
            self._spawn(self._to_every_address(peer, tip), f"tip {address} -> {peer}")

    def _spawn(self, work: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.failed += 1
            log.error("sending a tip failed: %s", exc, exc_info=exc)

    async def targets(self, peer: str) -> list[str]:
        """The URLs `peer` stands for now: one per address its name resolves to, ours left out (https:
        the URL itself). Raises PeerDown when the name does not resolve."""
        url = httpx.URL(peer)
        port = url.port or (443 if url.scheme == "https" else 80)
        if url.scheme == "https":
            return [peer]
        try:
            addresses = await self.resolver(url.host, port)
            own = set(await self.resolver(self.own_host, self.own_port)) | {self.own_host}
        except OSError as exc:
            raise PeerDown(f"{url.host} does not resolve: {exc}") from exc
        return [address_url(url.scheme, a, port) for a in addresses if not is_self(a, port, (own, self.own_port))]

    async def _to_every_address(self, peer: str, tip: Tip) -> None:
        try:
            async for attempt in self._retrying():
                with attempt:
                    urls = await self.targets(peer)
        except PeerDown as exc:
            self.failed += 1
            log.warning("tip about %s not sent to %s: %s", tip.address, peer, exc)
            return
        if not urls:
            log.info("tip about %s: %s names only this coordinator", tip.address, peer)
        for url in urls:
            self._spawn(self._deliver(url, tip), f"tip {tip.address} -> {url}")

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(ATTEMPTS),
            wait=wait_exponential(multiplier=0.5, max=2.0),
            retry=retry_if_exception_type(PeerDown),
            reraise=True,
        )

    async def _deliver(self, peer: str, tip: Tip) -> None:
        body = tip.body()
        headers = {MAC_HEADER: sign(self.key, body), "content-type": "application/json"}
        try:
            async for attempt in self._retrying():
                with attempt:
                    status = await self._post(f"{peer}/v1/swarm/tips", body, headers)
        except PeerDown as exc:
            self.failed += 1
            log.warning("tip about %s not delivered to %s after %d tries: %s", tip.address, peer, ATTEMPTS, exc)
            return
        if status >= 400:
            self.failed += 1
            log.warning("coordinator %s refused our tip about %s (HTTP %d)", peer, tip.address, status)
        else:
            self.sent += 1
            log.info("told coordinator %s that %s was convicted", peer, tip.address)

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        try:
            reply = await self._client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise PeerDown(f"{type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 500:
            raise PeerDown(f"HTTP {reply.status_code}")
        return reply.status_code

    async def close(self) -> None:
        while self._tasks:  # a resolution may spawn deliveries while we cancel: until none is left
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
