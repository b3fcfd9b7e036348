"""Relay hand-backs checked by the coordinator itself (docs/relay.md, "Blame").

A node that hands back says the next node of its chain failed. Nothing proves it: a timeout or a
refusal leaves no trace the coordinator could check, and a hostile node could say it on every chain to
get an honest node ejected. So the named node's failure is never recorded on that word. The request
just goes around it; meanwhile the coordinator probes it with its own health check, in the background
and bounded in time: a failed probe counts against the named node as any health check would (that is
how a dead node is still ejected), a passed one clears it. How the probe went is then counted for the
node that made the claim (claims.py), which is where repeated false claims have a consequence.

One probe per named node at a time: claims against a node already being probed wait for that probe's
outcome. At most `max_probes` at once: past that a claim is counted `unchecked` and left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from .registry import Registry

log = logging.getLogger(__name__)
MAX_PROBES = 32  # probes in flight at once (each is one or two small RPCs)
CONFIRMED, CONTRADICTED, UNCHECKED = "confirmed", "contradicted", "unchecked"

Probe = Callable[[str], Awaitable[bool | None]]  # HealthMonitor.probe: answered, or None (not known)


class HandbackReferee:
    def __init__(
        self,
        registry: Registry,
        probe: Probe,
        timeout_s: float,
        on_outcome: Callable[[str], None] | None = None,
        max_probes: int = MAX_PROBES,
    ) -> None:
        self.registry = registry
        self.probe = probe
        self.timeout_s = timeout_s
        self.on_outcome = on_outcome
        self.max_probes = max_probes
        self._claimers: dict[str, set[str]] = {}  # named node -> nodes that named it, while it is probed
        self._tasks: set[asyncio.Task[None]] = set()  # held, or a running probe could be garbage-collected
        self._closed = False  # the coordinator is stopping: no new probes (their channels are closing)

    @property
    def probing(self) -> frozenset[str]:
        return frozenset(self._claimers)

    def claim(self, claimer: str, named: str) -> None:
        """`claimer` handed back naming `named` as failed: probe `named` ourselves, without waiting."""
        if named in self._claimers:
            self._claimers[named].add(claimer)
            return
        if self._closed or len(self._claimers) >= self.max_probes or named not in self.registry.nodes:
            log.info("hand-back by %s naming %s unchecked (%d probes running)", claimer, named, len(self._claimers))
            self._count(UNCHECKED)
            return
        self._claimers[named] = {claimer}
        task = asyncio.create_task(self._probe(named), name=f"hand-back probe {named}")
        self._tasks.add(task)
        task.add_done_callback(self._probed)

    async def wait(self) -> None:
        """Until the probes running now have ended (for tests and shutdown)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await self.wait()

    async def _probe(self, named: str) -> None:
        answered: bool | None = None
        try:
            answered = await self._answered(named)
        finally:  # however it ended, the claims it gathered are settled and the next claim probes anew
            self._judge(self._claimers.pop(named, set()), named, answered)

    async def _answered(self, named: str) -> bool | None:
        """The coordinator's own health check of `named`, bounded: no answer in time is a failure."""
        try:
            return await asyncio.wait_for(self.probe(named), self.timeout_s)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11 (Jetson images run 3.10)
            self.registry.health_failed(named, f"health probe after a hand-back: no answer within {self.timeout_s} s")
            return False

    def _judge(self, claimers: set[str], named: str, answered: bool | None) -> None:
        for claimer in claimers:
            if answered is None:
                self._count(UNCHECKED)
            elif not answered:
                self.registry.claims.confirmed(claimer)
                self._count(CONFIRMED)
            else:
                self._contradicted(claimer, named)

    def _contradicted(self, claimer: str, named: str) -> None:
        log.info("hand-back by %s contradicted: %s answers the coordinator's health check", claimer, named)
        self._count(CONTRADICTED)
        if self.registry.claims.contradicted(claimer):
            log.warning(
                "node %s: %d hand-backs in a row named nodes that answer: it only ends relay chains for %.0f s",
                claimer,
                self.registry.claims.strikes,
                self.registry.claims.bar_s,
            )

    def _count(self, outcome: str) -> None:
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def _probed(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())
