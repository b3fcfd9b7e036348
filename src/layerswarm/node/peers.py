"""A node's calls to the next node of a relay chain: one channel per peer, signed like the coordinator's.

The same handshake as coordinator -> node (wire/auth.py): Info with a fresh nonce must come back with
the peer's proof of the swarm token, for the block the chain names, before anything is signed for it;
a refusal with a new challenge (the peer restarted) makes it prove itself again on the next call.

Each link's fixed cost is probed: the handshake's round trip, then a health check (a few bytes) at
most every PROBE_EVERY_S while the link is in use. Without it a forwarded activation's time would
count the link's latency as bytes, and on a fast LAN that looks like a slow link (wrongly making
--wire-dtype auto pick int8 for a chain).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from layerswarm.wire.auth import NONCE_KEY, AuthError, CallSigner, info_identity
from layerswarm.wire.channels import PEER_CHANNEL_OPTIONS
from layerswarm.wire.discovery import HEALTH_SERVICE, METHOD_PREFIX
from layerswarm.wire.relay_stream import RelayLink
from layerswarm.wire.security import NODE_TLS_NAME, SecuritySettings
from layerswarm.wire.stats import ewma
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MAX_PEERS = 64  # channels kept open; the least recently used goes first
PROBE_EVERY_S = 5.0  # a link in use gets a fresh round-trip probe at most this often
PROBE_TIMEOUT_S = 2.0


class PeerRefused(Exception):
    """The peer is not one we may forward to (no proof of the token, or another block)."""


@dataclass
class LinkEstimate:
    """Passive estimate of one node -> node link from forwarded activations (EWMA), and its probed RTT."""

    send_ms: float = 0.0
    mbps: float = 0.0
    samples: int = 0
    rtt_ms: float = 0.0  # 0: not probed yet
    probed_at: float = -math.inf  # time.monotonic() of the last probe
    ALPHA = 0.2

    def observe(self, nbytes: int, ms: float) -> None:
        ms = max(ms, 0.01)
        mbps = nbytes * 8 / 1e3 / ms
        first = self.samples == 0  # the first sample starts each average
        self.send_ms = ewma(None if first else self.send_ms, ms, self.ALPHA)
        self.mbps = ewma(None if first else self.mbps, mbps, self.ALPHA)
        self.samples += 1

    def observe_rtt(self, ms: float) -> None:
        ms = max(ms, 0.001)
        self.rtt_ms = ewma(None if self.rtt_ms == 0.0 else self.rtt_ms, ms, self.ALPHA)  # 0: never probed
        self.probed_at = time.monotonic()


HEALTH_CHECK = "/grpc.health.v1.Health/Check"


class PeerClient:
    def __init__(self, address: str, security: SecuritySettings, max_message_bytes: int) -> None:
        assert security.token is not None  # chains are MACed with it: no relay without one
        options: list[tuple[str, Any]] = [
            *PEER_CHANNEL_OPTIONS,
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self.address = address
        if security.tls:  # the relay certificate: the next node lets it call Relay, RelayStream and Info only
            options.append(("grpc.ssl_target_name_override", NODE_TLS_NAME))
            self.channel = grpc.aio.secure_channel(address, security.relay_channel_credentials(), options=options)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        self.stub = pb_grpc.BlockNodeStub(self.channel)  # type: ignore[no-untyped-call]
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.signer = CallSigner(security.token)
        self.block: int | None = None
        self.handshake_rtt_ms: float | None = None  # the Info call's round trip, once per proof
        self.link = RelayLink(address, self._open_stream)
        self.streams = True  # False once the peer answered UNIMPLEMENTED to RelayStream (an older node)

    async def round_trip_ms(self, timeout: float) -> float:
        """One health check: the link's fixed cost (a few bytes each way), in milliseconds. Signed once the
        peer has proved itself: it then counts as a member's call there, not a stranger's (node/guard.py)."""
        metadata = (self.signer.sign(HEALTH_CHECK),) if self.signer.proven else ()
        started = time.monotonic()
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        await self.health.Check(request, timeout=timeout, metadata=metadata)
        return (time.monotonic() - started) * 1e3

    async def prove(self, block: int, timeout: float) -> None:
        """Make sure the peer proved it holds the token and serves `block` (once per peer boot)."""
        if self.signer.proven and self.block == block:
            return
        nonce = CallSigner.new_nonce()
        started = time.monotonic()
        call = self.stub.Info(pb.InfoRequest(), timeout=timeout, metadata=((NONCE_KEY, nonce),))
        reply = await call
        self.handshake_rtt_ms = (time.monotonic() - started) * 1e3
        trailing = await call.trailing_metadata()
        identity = info_identity(reply)
        if not self.signer.accept_info(trailing, nonce, identity):
            raise PeerRefused(f"{self.address} gave no proof of our swarm token")
        if reply.block_index != block:
            raise PeerRefused(f"{self.address} serves block {reply.block_index}, the chain says {block}")
        self.block = block

    async def relay(self, request: pb.RelayRequest, timeout: float, stream: bool) -> Any:
        """Send one chain's request on: on the peer's long-lived RelayStream (`stream`, unless the peer is
        too old for it) or as its own signed Relay call. Either way an object to read() its events from."""
        if stream and self.streams:
            try:
                return await self.link.send(request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:  # refused at open: nothing ran
                    raise
                log.info("%s has no RelayStream: a Relay call per chain from now on", self.address)
                self.streams = False
        return self.stub.Relay(request, timeout=timeout, metadata=(self._signed("Relay"),))

    def _open_stream(self) -> Any:
        """A new RelayStream call, signed when it opens (it lives until it breaks; no deadline)."""
        return self.stub.RelayStream(metadata=(self._signed("RelayStream"),))

    def _signed(self, method: str) -> tuple[str, str]:
        try:
            return self.signer.sign(METHOD_PREFIX + method)
        except AuthError as exc:
            raise PeerRefused(str(exc)) from exc

    def refused(self, exc: grpc.aio.AioRpcError) -> None:
        """A refusal carries the peer's challenge: a new one (a restart) must prove itself again."""
        if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
            self.signer.learn(exc.trailing_metadata())

    async def close(self) -> None:
        await self.link.close()
        await self.channel.close()


class PeerPool:
    def __init__(self, security: SecuritySettings, max_message_bytes: int) -> None:
        self.security = security
        self.max_message_bytes = max_message_bytes
        self._peers: OrderedDict[str, PeerClient] = OrderedDict()
        self.links: dict[str, LinkEstimate] = {}
        self._probes: dict[str, asyncio.Task[None]] = {}

    async def get(self, address: str) -> PeerClient:
        peer = self._peers.pop(address, None) or PeerClient(address, self.security, self.max_message_bytes)
        self._peers[address] = peer
        while len(self._peers) > MAX_PEERS:
            _, old = self._peers.popitem(last=False)
            await old.close()
        return peer

    def observe(self, address: str, nbytes: int, ms: float) -> None:
        link = self._link(address)
        if link is not None:
            link.observe(nbytes, ms)

    def _link(self, address: str) -> LinkEstimate | None:
        if address not in self.links and len(self.links) >= MAX_PEERS:
            return None  # bounded: the links measured first stay
        return self.links.setdefault(address, LinkEstimate())

    def rtt_ms(self, address: str) -> float:
        """The link's probed round trip (0.0: none yet)."""
        link = self.links.get(address)
        return link.rtt_ms if link is not None else 0.0

    def probe_soon(self, peer: PeerClient) -> None:
        """Keep the link's RTT fresh without delaying the chain: the handshake's round trip when there
        was one, else a health check in the background, at most every PROBE_EVERY_S per link."""
        link = self._link(peer.address)
        if link is None or time.monotonic() - link.probed_at < PROBE_EVERY_S or peer.address in self._probes:
            return
        if peer.handshake_rtt_ms is not None:
            link.observe_rtt(peer.handshake_rtt_ms)
            peer.handshake_rtt_ms = None
            return
        task = asyncio.create_task(self._probe(peer, link), name=f"probe {peer.address}")
        self._probes[peer.address] = task
        task.add_done_callback(lambda _: self._probes.pop(peer.address, None))

    @staticmethod
    async def _probe(peer: PeerClient, link: LinkEstimate) -> None:
        try:
            link.observe_rtt(await peer.round_trip_ms(PROBE_TIMEOUT_S))
        except grpc.aio.AioRpcError as exc:  # the chain's own calls report a dead peer; this only measures
            log.debug("probe of %s failed: %s", peer.address, exc.code().name)
            link.probed_at = time.monotonic()  # not again before the next interval

    def link_stats(self) -> list[pb.LinkStat]:
        return [
            pb.LinkStat(peer=a, ewma_send_ms=e.send_ms, ewma_mbps=e.mbps, samples=e.samples, rtt_ms=e.rtt_ms)
            for a, e in sorted(self.links.items())
        ]

    async def close(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()


def now_ms() -> float:
    return time.monotonic() * 1e3
