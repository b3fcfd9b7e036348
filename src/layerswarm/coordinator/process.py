"""The coordinator process: its parts built from the settings, started and stopped in order, and
whether it is ready. It routes no request itself: requests go to `router` (routing/router.py)."""

from __future__ import annotations

import logging

from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.config import ViTConfig
from layerswarm.wire.auth import derive_key

from .assembly import default_min_blocks, family_spec, log_node_event, make_verifier, wire_format
from .http.admission import Admission
from .membership.clients import ClientPool
from .membership.records import NodeEvent
from .membership.registry import Registry
from .membership.watch import SwarmWatch
from .metrics import CoordinatorMetrics
from .relay.chains import RelayRunner
from .relay.handbacks import HandbackReferee, forward_probe
from .routing.executor import PathExecutor
from .routing.router import Router
from .settings import CoordinatorSettings

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.manifest = read_manifest(settings.model_dir)
        min_blocks = default_min_blocks(settings, self.manifest)  # first: an impossible one is a usage error
        self.registry = Registry(
            family_spec(settings),
            settings.eject_after,
            settings.quarantine_s,
            on_change=self._on_node_event,
            conviction_cooldown_s=settings.conviction_cooldown_s,
        )
        self.pool = ClientPool(transport=settings.transport, security=settings.security)
        self.verifier = make_verifier(settings)
        if self.verifier is not None:
            self.verifier.quarantine_referee = self.registry.quarantine
            self.verifier.contest = self.registry.contest
        self.metrics = CoordinatorMetrics(self.registry, self.verifier)  # before any node event is counted
        self.admission = Admission(settings.max_concurrent_requests, self.metrics.in_flight)
        self.watch = SwarmWatch(settings, self.registry, self.pool)
        wire = wire_format(settings, self.config)
        executor = PathExecutor(self.registry, self.pool, self.verifier, settings, wire)
        probe = forward_probe(self.registry, self.pool, settings.hop_timeout_s)
        self.handbacks = HandbackReferee(
            self.registry, probe, 2 * settings.hop_timeout_s, self.metrics.observe_handback
        )
        token = settings.security.token
        relay = (
            RelayRunner(
                self.registry,
                self.pool,
                executor,
                derive_key(token),
                wire,
                settings.hop_timeout_s,
                self.verifier,
                self.handbacks,
            )
            if settings.topology in ("relay", "auto") and token
            else None
        )
        self.router = Router(
            settings, self.manifest, min_blocks, wire, self.registry, self.watch, executor, relay, self.metrics
        )

    @property
    def config(self) -> ViTConfig:
        return self.manifest.config

    def _on_node_event(self, event: NodeEvent) -> None:
        log_node_event(event)
        if event.old is not event.new:  # not a convicted node refused again (it stays where it was)
            self.metrics.node_transitions.labels(event.new.value if event.new else "forgotten").inc()
        if event.new is None and self.verifier is not None:  # it left: its per-node state goes too
            self.verifier.forget(event.address)

    async def start(self) -> None:
        """Look where the nodes were (remembered, static, DNS peers), start mDNS, and finish the first
        round in the background: until then /readyz says so and classify waits instead of a 503."""
        await self.watch.start()

    async def stop(self) -> None:
        await self.watch.stop_discovery()  # first: discovery asks for health checks
        await self.handbacks.close()
        await self.watch.stop()
        await self.router.close()
        await self.pool.close()
        if self.verifier is not None:
            self.verifier.close()

    def ready(self) -> tuple[bool, str]:
        if not self.watch.first_round_done:
            return False, "starting: the first discovery and health round is not complete"
        return self.router.depth_ready()
