"""Keeping the registry current: discovery (mDNS, DNS peers), health checks, the peers remembered from
the last run, and the first round after start-up (until it is done, readiness says so and requests
wait for it instead of getting a 503 for a swarm that is there)."""

from __future__ import annotations

import asyncio
import logging
import time

from layerswarm.wire.periodic import Periodic

from ..settings import CoordinatorSettings
from .clients import ClientPool
from .discovery import DnsDiscovery, MdnsDiscovery
from .health import REMEMBERED, HealthMonitor
from .peer_memory import load_peers, save_peers
from .records import NodeState
from .registry import Registry

log = logging.getLogger(__name__)
MDNS_QUIET_S = 0.3  # the first round waits until no advert came for this long
MEMORY_INTERVAL_S = 2.0  # how often the set of proven peers is compared with the one last saved


class SwarmWatch:
    def __init__(self, settings: CoordinatorSettings, registry: Registry, pool: ClientPool) -> None:
        self.settings = settings
        self.registry = registry
        self.monitor = HealthMonitor(registry, pool, settings.health_interval_s, settings.health_timeout_s)
        verify = self.monitor.verify_soon
        self.discovery = MdnsDiscovery(registry, settings.mdns_interfaces, verify) if settings.mdns else None
        self.dns = DnsDiscovery(registry, settings.peer_dns, verify=verify) if settings.peer_dns else None
        self.memory = Periodic("peer-memory", MEMORY_INTERVAL_S, self._remember_peers)
        self._first_round = asyncio.Event()  # set once the first discovery and health round is done
        self._first_round_task: asyncio.Task[None] | None = None
        self._saved_peers: set[str] | None = None
        for peer in settings.peers:
            registry.add_candidate(peer, "static")

    @property
    def first_round_done(self) -> bool:
        return self._first_round.is_set()

    async def start(self) -> None:
        """Look where the nodes were (remembered, static, DNS peers), start mDNS, and finish the first
        round in the background."""
        started = time.monotonic()
        if self.settings.state_file is not None:
            for peer in load_peers(self.settings.state_file, self.registry.family.family_id):
                self.registry.add_candidate(peer, REMEMBERED)
        if self.discovery is not None:
            await self.discovery.start()
        if self.dns is not None:
            await self.dns.start()
        await self.monitor.check_all()
        self.monitor.start()
        if self.settings.state_file is not None:
            self.memory.start()
        self._first_round_task = asyncio.create_task(self._finish_first_round(started), name="first-round")

    async def _finish_first_round(self, started: float) -> None:
        """mDNS answers come in over the first second or so: wait for them to go quiet and for one
        check of each node, bounded by `startup_wait_s` (sooner once every block is reachable)."""
        deadline = started + self.settings.startup_wait_s
        settle_until = started + (self.settings.mdns_settle_s if self.discovery is not None else 0.0)
        depth = self.registry.family.depth
        while time.monotonic() < deadline:
            now = time.monotonic()
            all_checked = all(r.checked for r in self.registry.nodes.values())
            quiet = self.discovery is None or now - self.discovery.last_heard >= MDNS_QUIET_S
            if all_checked and self.registry.reachable_depth() >= depth:
                break
            if all_checked and quiet and now >= settle_until:
                break
            await asyncio.sleep(0.05)
        self._first_round.set()
        log.info(
            "first discovery round done in %.2f s: %d of %d blocks reachable",
            time.monotonic() - started,
            self.registry.reachable_depth(),
            depth,
        )

    async def wait_first_round(self, timeout_s: float) -> None:
        """Wait (bounded) until the first discovery round is done: answering before it would be a 503
        for a swarm that is there."""
        try:
            await asyncio.wait_for(self._first_round.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:  # Python 3.10: asyncio's own class, not the builtin (one class from 3.11 on)
            log.warning("first discovery round still running after %.1f s: answering anyway", timeout_s)

    async def _remember_peers(self) -> None:
        assert self.settings.state_file is not None
        peers = {r.address for r in self.registry.nodes.values() if r.proven and r.state is not NodeState.IGNORED}
        if peers == self._saved_peers:
            return
        self._saved_peers = peers  # tried once per change: an unwritable state dir warns, never spams
        try:
            await asyncio.to_thread(save_peers, self.settings.state_file, self.registry.family.family_id, list(peers))
        except OSError as exc:
            log.warning(
                "cannot write peer state file %s: %s (restarts will not remember peers)", self.settings.state_file, exc
            )

    async def stop_discovery(self) -> None:
        """Stop looking for nodes (the first round, peer memory with a last save, mDNS, DNS); health
        checks go on until `stop`. Discovery first: it asks the monitor for checks."""
        if self._first_round_task is not None:
            self._first_round_task.cancel()
            await asyncio.gather(self._first_round_task, return_exceptions=True)
        await self.memory.stop()
        if self.settings.state_file is not None:
            await self.memory.run_once()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.dns is not None:
            await self.dns.stop()

    async def stop(self) -> None:
        """Stop the health checks (after `stop_discovery`)."""
        await self.monitor.stop()
