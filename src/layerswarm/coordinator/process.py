"""The coordinator process: its parts built from the settings, started and stopped in order, and
whether it is ready. It routes no request itself: a classifier family's requests go to `router`
(routing/router.py), a decoder family's streams to `generator` (generation/generator.py)."""

from __future__ import annotations

import logging

from layerswarm.models.checkpoint import AnyManifest, Manifest, is_lm, read_any_manifest
from layerswarm.models.config import ViTConfig
from layerswarm.models.lm.config import LMConfig
from layerswarm.wire.auth import derive_key

from .assembly import (
    depth_rule,
    family_spec,
    generation_wire,
    log_node_event,
    make_decode_verifier,
    make_verifier,
    wire_format,
)
from .generation.generator import Generator
from .http.admission import Admission
from .membership.clients import ClientPool
from .membership.records import NodeEvent, NodeState
from .membership.registry import Registry
from .membership.tip_sender import TipSender
from .membership.tips import TIP_HOPS, TipError, TipInbox, tip_key
from .membership.watch import SwarmWatch
from .metrics import CoordinatorMetrics
from .relay.chains import RelayRunner
from .relay.handbacks import HandbackReferee, forward_probe
from .routing.depth import ReadinessView
from .routing.executor import PathExecutor
from .routing.router import Router
from .settings import CoordinatorSettings
from .verification.decode_check import DecodeVerifier
from .verification.verifier import Verifier

log = logging.getLogger(__name__)


class WrongFamily(AttributeError):
    """A part of the other kind of family asked for (the router of a decoder's coordinator)."""


class Coordinator:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.manifest: AnyManifest = read_any_manifest(settings.model_dir)
        self.registry = Registry(
            family_spec(settings, self.manifest),
            settings.eject_after,
            settings.quarantine_s,
            on_change=self._on_node_event,
            conviction_cooldown_s=settings.conviction_cooldown_s,
        )
        self.pool = ClientPool(transport=settings.transport, security=settings.security)
        self.verifier: Verifier | None = None  # a classifier family's
        self.decode_verifier: DecodeVerifier | None = None  # a decoder family's
        self._router: Router | None = None
        self._generator: Generator | None = None
        self._handbacks: HandbackReferee | None = None
        token = settings.security.token
        # Other coordinators' convictions, as tips (membership/tips.py): taken with the token, sent where
        # --coordinator-peer says (a name: to every address it resolves to but ours).
        self.tips = TipInbox(tip_key(token)) if token else None
        self.tip_sender = (
            TipSender(settings.coordinator_peers, tip_key(token), settings.http_host, settings.http_port)
            if token and settings.coordinator_peers
            else None
        )
        self.tips_acted = 0
        if is_lm(self.manifest):
            self._build_generation(self.manifest)
        else:
            self._build_classification(self.manifest)  # type: ignore[arg-type]

    def _build_classification(self, manifest: Manifest[ViTConfig]) -> None:
        settings = self.settings
        depths = depth_rule(settings, manifest)  # first: an impossible one is a usage error
        self.verifier = make_verifier(settings)
        if self.verifier is not None:
            self.verifier.quarantine_referee = self.registry.quarantine
            self.verifier.contest = self.registry.contest
        self.metrics = CoordinatorMetrics(self.registry, self.verifier)  # before any node event is counted
        self.admission = Admission(settings.max_concurrent_requests, self.metrics.in_flight)
        self.watch = SwarmWatch(settings, self.registry, self.pool)
        wire = wire_format(settings, manifest.config)
        executor = PathExecutor(self.registry, self.pool, self.verifier, settings, wire)
        probe = forward_probe(self.registry, self.pool, settings.hop_timeout_s)
        self._handbacks = HandbackReferee(
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
                self._handbacks,
            )
            if settings.topology in ("relay", "auto") and token
            else None
        )
        self._router = Router(
            settings, manifest, depths, wire, self.registry, self.watch, executor, relay, self.metrics
        )

    def _build_generation(self, manifest: Manifest[LMConfig]) -> None:
        settings = self.settings
        self.decode_verifier = make_decode_verifier(settings)
        self.metrics = CoordinatorMetrics(self.registry, self.decode_verifier, generative=True)
        self.admission = Admission(settings.max_concurrent_requests, self.metrics.in_flight)
        self.watch = SwarmWatch(settings, self.registry, self.pool)
        self._generator = Generator(
            settings,
            manifest,
            self.registry,
            self.pool,
            self.watch,
            self.decode_verifier,
            generation_wire(settings),
            self.metrics,
        )

    @property
    def router(self) -> Router:
        """A classifier family's router (classify)."""
        if self._router is None:
            raise WrongFamily(f"{self.settings.model_dir} is a language model: its streams go to `generator`")
        return self._router

    @property
    def generator(self) -> Generator:
        """A decoder family's generator (streams)."""
        if self._generator is None:
            raise WrongFamily(f"{self.settings.model_dir} is a classifier: its requests go to `router`")
        return self._generator

    @property
    def generative(self) -> bool:
        return self._generator is not None

    @property
    def config(self) -> ViTConfig | LMConfig:
        return self.manifest.config

    @property
    def handbacks(self) -> HandbackReferee:
        """A classifier family's referee of relay hand-backs."""
        if self._handbacks is None:
            raise WrongFamily(f"{self.settings.model_dir} is a language model: it runs no relay chains")
        return self._handbacks

    def _on_node_event(self, event: NodeEvent) -> None:
        log_node_event(event)
        if event.old is not event.new:  # not a convicted node refused again (it stays where it was)
            self.metrics.node_transitions.labels(event.new.value if event.new else "forgotten").inc()
        if event.new is NodeState.QUARANTINED and event.old is not event.new:
            self._tell_peers(event)
        if event.new is None:  # it left: its per-node state goes too
            for verifier in (self.verifier, self.decode_verifier):
                if verifier is not None:
                    verifier.forget(event.address)

    def _tell_peers(self, event: NodeEvent) -> None:
        record = self.registry.nodes.get(event.address)
        if self.tip_sender is None or record is None or not record.convicted or record.identity is None:
            return  # quarantined for a failure, not on evidence: nothing another coordinator must know
        self.tip_sender.convicted(event.address, record.identity.boot_id, event.reason)

    def take_tip(self, body: bytes, mac: str | None) -> bool:
        """Another coordinator convicted a node: re-execute its next hops here (never convict on its word).
        Raises TipError (no token here: 404, as if there were no such endpoint; else tips.py's reasons)."""
        if self.tips is None:
            raise TipError(404, "this coordinator has no swarm token: it takes no tips")
        tip = self.tips.accept(body, mac)
        if tip is None:
            return False  # its node was tipped a moment ago: already being re-checked
        if self.verifier is None:  # verification off, or a decoder family (its checks take no tips yet)
            log.warning("coordinator %s says %s lied (%s); no verification here", tip.sender, tip.address, tip.reason)
            return False
        self.verifier.tip(tip.address, TIP_HOPS)
        self.tips_acted += 1
        log.warning(
            "coordinator %s convicted %s (%s): its next %d hops here are re-executed",
            tip.sender, tip.address, tip.reason, TIP_HOPS,
        )  # fmt: skip
        return True

    async def start(self) -> None:
        """Look where the nodes were (remembered, static, DNS peers), start mDNS, and finish the first
        round in the background: until then /readyz says so and requests wait instead of a 503."""
        await self.watch.start()

    async def stop(self) -> None:
        await self.watch.stop_discovery()  # first: discovery asks for health checks
        if self._generator is not None:
            await self._generator.aclose()  # while the channels are open: Release reaches the nodes
        if self._handbacks is not None:
            await self._handbacks.close()
        await self.watch.stop()
        if self._router is not None:
            await self._router.close()
        await self.pool.close()
        if self.tip_sender is not None:
            await self.tip_sender.close()
        if self.verifier is not None:
            self.verifier.close()

    def readiness(self) -> ReadinessView:
        """How many blocks must answer, as the ready line and `layerswarm up` state it (routing/depth.py)."""
        if self._generator is not None:
            need, depth = self._generator.min_depth, self._generator.config.depth
            rule = f"a stream keeps at least {need} of {depth} blocks; a block it cannot keep above that fails it"
            return {"min_blocks": need, "depth": depth, "rule": rule}
        depths = self.router.depth_rule
        return {"min_blocks": depths.min_blocks, "depth": depths.depth, "rule": depths.describe()}

    def ready(self) -> tuple[bool, str]:
        if not self.watch.first_round_done:
            return False, "starting: the first discovery and health round is not complete"
        if self._generator is not None:
            return self._generator.depth_ready()
        return self.router.depth_ready()
