"""Start a node: verify the block, serve gRPC (+ health, metrics), then advertise; drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import uuid
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from layerswarm.models.config import ViTConfig
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.manifest import read_any_manifest
from layerswarm.wire.auth import NodeAuthenticator
from layerswarm.wire.discovery import HEALTH_SERVICE, PROTOCOL_VERSION, Advert
from layerswarm.wire.exposure import insecure_notice
from layerswarm.wire.security import CoordinatorRoleInterceptor
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from .advertise import Advertised, Advertiser, advertised_addresses
from .decode import DecodeService
from .engines import BlockEngine, load_engine
from .guard import CallGuard, CallLimits, MemoryKeeper
from .health import BootHealthServicer
from .metrics import NodeMetrics
from .relay import Relayer
from .runtime import BlockRuntime
from .service import BlockService, block_tokens
from .settings import NodeSettings

log = logging.getLogger(__name__)


def receive_limit(settings: NodeSettings, cfg: ViTConfig | LMConfig) -> int:
    """The largest request this node has a use for: `max_batch` activations of its model in float32
    (int8 with its scales is smaller), twice for a text hop's frozen states (a decoder's Decode: its
    activations and CALM fill, one row each, within that), the token mask at 8 bytes a token, and 1 MiB
    for the rest (ids, a relay chain). gRPC refuses a larger message before reading it
    (RESOURCE_EXHAUSTED), so a stranger's padded call, read before its refusal, costs the node this and
    not the configured ceiling: about 1.3 MB for the shipped model's nodes instead of 64 MiB."""
    tokens = block_tokens(cfg)  # a text model's longest sequence, a decoder's context
    doubled = isinstance(cfg, LMConfig) or cfg.is_text
    activations = settings.max_batch * tokens * cfg.dim * 4 * (2 if doubled else 1)
    return min(settings.max_message_bytes, activations + settings.max_batch * tokens * 8 + (1 << 20))


def grpc_options(max_receive_bytes: int, max_send_bytes: int, limits: CallLimits) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", max_send_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        # HTTP/2 streams one connection may hold open at once (a peer opening more waits for one to end),
        # and connections at once (past it, new ones are refused).
        ("grpc.max_concurrent_streams", limits.per_peer),
        ("grpc.max_allowed_incoming_connections", limits.connections),
        # No bandwidth-delay probing: it grows every stream's receive window to megabytes, which a
        # stranger fills before its call is refused (a tokenless flood of 8 connections: +130 MiB kept
        # after it, against +7 MiB without). A call the node reads opens its window to the whole
        # message, so a legit large message costs at most one more round trip (same p50 on loopback
        # at 4.3 MB).
        ("grpc.http2.bdp_probe", 0),
    ]


def call_limits(settings: NodeSettings) -> CallLimits:
    return CallLimits(
        total=settings.max_calls,
        per_peer=settings.max_calls_per_peer,
        strangers=settings.max_stranger_calls,
        stranger_per_peer=settings.max_stranger_calls_per_peer,
        stranger_rate=settings.stranger_rate,
    )


class Node:
    """A running node. `start()` returns once it serves and is advertised; `stop()` drains."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.boot_id = uuid.uuid4().hex
        self.manifest = read_any_manifest(settings.model_dir)
        engine = load_engine(settings.model_dir, settings.block, self.manifest, settings.engine, settings.device)
        self.runtime = self.make_runtime(engine)
        self.relayer = Relayer(
            settings.security, settings.max_message_bytes, streams=settings.relay_streams, block=settings.block
        )
        self.metrics = NodeMetrics(settings.block, self.manifest.model_id)
        self.health = BootHealthServicer(self.boot_id)
        token = settings.security.token
        self.auth = NodeAuthenticator(token) if token else None
        # Credentials and call limits are decided before any message is read (guard.py); with TLS the
        # client certificate's role is checked before them (a probe's certificate reaches health only).
        limits = call_limits(settings)
        self.guard = CallGuard(self.auth, limits)
        self.memory = MemoryKeeper(self.guard.slots)
        interceptors: list[Any] = [CoordinatorRoleInterceptor(), self.guard] if settings.security.tls else [self.guard]
        self.receive_limit = receive_limit(settings, self.manifest.config)
        self.server = grpc.aio.server(
            options=grpc_options(self.receive_limit, settings.max_message_bytes, limits),
            interceptors=interceptors,
            maximum_concurrent_rpcs=limits.total,
        )
        self.port = 0
        self.service: BlockService | None = None
        # Decoder blocks: the generation streams' caches and their steps (node/decode.py).
        self.decode = DecodeService(self.runtime, settings, self.metrics) if self.runtime.decoder else None
        self.advertiser: Advertiser | None = None
        self.advertised: Advertised | None = None  # what the mDNS record says, and why (in the ready line)
        self._metrics_server: tuple[Any, Any] | None = None

    def make_runtime(self, engine: BlockEngine) -> BlockRuntime:
        s = self.settings
        return BlockRuntime(engine, s.block, self.manifest, micro_batch=s.micro_batch, max_batch=s.max_batch)

    def make_service(self) -> BlockService:
        """The servicer. The test-only fault harness (harness/faults.py) overrides this and
        make_runtime to build a lying node from the real parts; production code never does."""
        return BlockService(self.runtime, self.settings, self.metrics, self.boot_id, self.relayer, self.decode)

    async def start(self) -> None:
        s = self.settings
        self.service = self.make_service()
        pb_grpc.add_BlockNodeServicer_to_server(self.service, self.server)  # type: ignore[no-untyped-call]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"{s.host}:{s.port}"
        if s.security.tls:
            self.port = self.server.add_secure_port(address, s.security.server_credentials())
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {s.host}:{s.port}")
        await self.server.start()
        self.memory.start()
        if (notice := insecure_notice(s.host, s.security, s.insecure)) is not None:
            log.warning("%s", notice)
        if self.decode is not None:
            self.decode.start()
        for service in ("", HEALTH_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if s.metrics_port is not None:
            self._metrics_server = start_http_server(s.metrics_port, addr=s.host, registry=self.metrics.registry)
        if s.advertise:  # only once gRPC answers: a browser may call us as soon as it sees the record
            advert = Advert(
                family=self.manifest.family_id,
                model=self.manifest.model_id,
                block=s.block,
                variant=self.manifest.variant,
                proto=PROTOCOL_VERSION,
                boot=self.boot_id,
                sha=self.manifest.block_sha256(s.block)[:16],
            )
            self.advertised = advertised_addresses(s.host, s.advertise_address)
            log.info(
                "advertising %s port %d over mDNS: %s",
                ", ".join(self.advertised.addresses),
                self.port,
                self.advertised.rule,
            )
            self.advertiser = Advertiser(
                advert, self.manifest.model_id, self.port, self.advertised.addresses, s.mdns_interfaces
            )
            await self.advertiser.start()

    async def stop(self) -> None:
        """Refuse new work (health NOT_SERVING), drain in-flight requests, then say goodbye on mDNS."""
        await self.health.enter_graceful_shutdown()
        if self.service is not None:
            self.service.closing.set()  # relay streams end once their chains have (they never end by themselves)
        await self.server.stop(self.settings.grace_s)
        await self.memory.stop()
        if self.decode is not None:
            await self.decode.stop()
        if self.advertiser is not None:
            await self.advertiser.stop()
        if self._metrics_server is not None:
            server, _thread = self._metrics_server
            server.shutdown()
        await self.relayer.close()
        self.runtime.close()

    def ready_line(self) -> str:
        return json.dumps(
            {
                "event": "ready",
                "role": "node",
                "host": self.settings.host,
                "port": self.port,
                "block": self.settings.block,
                "model_id": self.manifest.model_id,
                "family_id": self.manifest.family_id,
                "boot_id": self.boot_id,
                "engine": self.runtime.engine.name,  # torch or numpy (--engine)
                "device": self.runtime.device,
                # Where peers are told to dial (none: --no-advertise), and the rule that chose it.
                "advertised": self.advertised.addresses if self.advertised else [],
                "advertised_by": self.advertised.rule if self.advertised else None,
            }
        )


async def serve(settings: NodeSettings, node_type: type[Node] = Node) -> None:
    node = node_type(settings)
    await node.start()
    print(node.ready_line(), flush=True)  # the CLI's own output: supervisors and tests wait for it
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining for up to %.1f s", settings.grace_s)
    await node.stop()


def run(settings: NodeSettings, node_type: type[Node] = Node) -> int:
    asyncio.run(serve(settings, node_type))
    sys.stdout.flush()
    return 0
