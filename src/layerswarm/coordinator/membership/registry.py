"""The swarm as the coordinator sees it: pure bookkeeping, no sockets, testable with a fake clock.

Hints (mDNS records, static and DNS peers, the remembered peers of a previous run) only say where to
look: a hint never admits, changes or removes a node. Identity comes from the node's own
authenticated Info reply; liveness from health checks and real traffic. A node is routable only once
these agree, and leaves the list only when it has no hint left AND fails to answer over its own
connection. Unproven mDNS candidates are bounded (in all and per advertised host), so a flood of
forged adverts cannot grow memory or the health monitor's work without limit.

Every state change is reported to `on_change` (the caller logs it): the registry itself does no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from layerswarm.wire.discovery import PROTOCOL_VERSION
from layerswarm.wire.stats import ewma

from .claims import Claims, ClaimsView
from .convictions import MAX_BAR_S, Convictions, ConvictionView
from .linkmap import LinkMap, LinkView
from .records import MDNS, Evidence, FamilySpec, NodeEvent, NodeIdentity, NodeRecord, NodeState, RecordView


class NodeView(RecordView, ConvictionView, ClaimsView):
    """A node as /v1/nodes shows it: its record, its address's convictions and claims, its links."""

    links: dict[str, LinkView]  # measured out of it, by destination


WeightsKey = tuple[str, int, str]  # model id, block index, weights sha256


def weights_key(identity: NodeIdentity) -> WeightsKey:
    return identity.model_id, identity.block, identity.weights_sha256


@dataclass(frozen=True)
class Contest:
    until: float  # on the registry's clock
    reason: str


class ContestView(TypedDict):
    model_id: str
    block: int
    weights_sha256: str
    reason: str
    until: float  # Unix seconds


class Registry:
    EWMA_ALPHA = 0.2
    MAX_MDNS_HINTS = 8  # instance names remembered per address

    def __init__(
        self,
        family: FamilySpec,
        eject_after: int = 2,
        quarantine_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[NodeEvent], None] | None = None,
        max_unproven: int = 128,
        max_unproven_per_host: int = 32,
        conviction_cooldown_s: float = 600.0,
        conviction_max_cooldown_s: float = MAX_BAR_S,
        wall: Callable[[], float] = time.time,  # only to show when a bar ends (the clock may be monotonic)
    ) -> None:
        self.family = family
        self.eject_after = eject_after
        self.quarantine_s = quarantine_s
        self.clock = clock
        self.on_change = on_change
        self.max_unproven = max_unproven
        self.max_unproven_per_host = max_unproven_per_host
        self.nodes: dict[str, NodeRecord] = {}
        self.links = LinkMap()  # measured transfer costs (coordinator <-> node, node -> node)
        self.convictions = Convictions(
            conviction_cooldown_s, clock, conviction_max_cooldown_s
        )  # by address: outlive records
        self.wall = wall
        self.claims = Claims(clock)  # relay hand-backs, by how the coordinator's probes judged them
        # Weights (model id, block, sha256) whose replicas disagreed where we hold no copy to tell who is
        # right (verification/peer_check.py): not routed to until the clock passes `until`; nobody convicted.
        self.contested: dict[WeightsKey, Contest] = {}

    # --- membership --------------------------------------------------------------------------------------

    def add_candidate(
        self, address: str, source: str, advert_family: str | None = None, hint: str | None = None
    ) -> NodeRecord | None:
        """Note a hint that a node may live at `address`. Returns None when an unproven mDNS candidate
        is refused because the bounds are reached (a flood of adverts)."""
        hint = hint or source
        record = self.nodes.get(address)
        new = record is None
        if record is None:
            if source == MDNS and not self._room_for_mdns(address):
                return None
            record = NodeRecord(address=address, source=source, state_since=self.clock())
            self.nodes[address] = record
        mdns_hints = [h for h in record.hints if h.startswith(MDNS)]
        if hint.startswith(MDNS) and hint not in record.hints and len(mdns_hints) >= self.MAX_MDNS_HINTS:
            del record.hints[mdns_hints[0]]  # many names for one address: keep the newest few
        record.hints[hint] = advert_family
        if advert_family is not None:
            record.advert_family = advert_family
        # An advert may only decide whether to look at a new address at all, never change a state:
        # a stranger's family is not contacted, until some hint says it is one of ours.
        if new and not record.worth_contacting(self.family.family_id):
            self._set(record, NodeState.IGNORED, f"advertises family {advert_family}, not ours (not contacted)")
        elif (
            record.state is NodeState.IGNORED
            and record.identity is None
            and record.worth_contacting(self.family.family_id)
        ):
            self._set(record, NodeState.PENDING, "waiting for Info")
        return record

    def drop_hint(self, address: str, hint: str) -> bool:
        """A hint is gone (mDNS goodbye, DNS no longer lists it). Changes no state: returns True when
        the node has no hint left, so the caller verifies it over its own connection now."""
        record = self.nodes.get(address)
        if record is None or record.hints.pop(hint, "absent") == "absent":
            return False
        return not record.hints

    def forget(self, address: str, reason: str) -> None:
        """Drop a node that has no hint left and failed to answer: it left the swarm."""
        record = self.nodes.get(address)
        if record is not None and not record.hints:
            del self.nodes[address]
            self.links.forget(address)
            self._emit(NodeEvent(address, record.state, None, reason))

    def _room_for_mdns(self, address: str) -> bool:
        """Bounds on unproven mDNS-only candidates, in all and per advertised host: when full, the
        oldest one that has already failed a check (or is not contacted) makes room."""
        host = address.rpartition(":")[0]
        unproven = [r for r in self.nodes.values() if r.mdns_only and not r.proven]
        same_host = [r for r in unproven if r.host == host]
        for group, limit in ((same_host, self.max_unproven_per_host), (unproven, self.max_unproven)):
            if len(group) < limit:
                continue
            evictable = [r for r in group if r.consecutive_failures > 0 or r.state is NodeState.IGNORED]
            if not evictable:
                return False
            oldest = min(evictable, key=lambda r: r.state_since)
            del self.nodes[oldest.address]
            self._emit(NodeEvent(oldest.address, oldest.state, None, "unproven mDNS candidate evicted: too many"))
        return True

    def admit(self, address: str, identity: NodeIdentity) -> NodeRecord:
        """Record what a node proved it is (authenticated Info), and decide whether it is one of ours."""
        record = self.nodes.get(address)
        if record is None:  # not heard of (or evicted meanwhile): a record with no hint of its own
            record = self.nodes[address] = NodeRecord(address=address, source="admitted", state_since=self.clock())
        new_boot = record.identity is not None and record.identity.boot_id != identity.boot_id
        if new_boot:
            record.ewma_ms, record.consecutive_failures = None, 0  # a new incarnation starts fresh
            record.recent_ms.clear()
            record.convicted = record.barred = False
        record.identity = identity
        refusal = self._refusal(identity)
        # The boot id is the node's own claim: a conviction at this address outlives it (convictions.py).
        bar = self.convictions.bar(address, identity.boot_id)
        if refusal:
            self._set(record, NodeState.IGNORED, refusal)
        elif bar is not None and not record.convicted:  # (a convicted incarnation keeps its evidence's reason)
            record.proven, record.barred = True, True
            self._set(record, NodeState.QUARANTINED, bar, announce=new_boot)
        elif (contest := self._contest_of(identity)) is not None:
            record.proven = True
            self._set(record, NodeState.QUARANTINED, contest.reason)
        elif new_boot and record.state in (NodeState.HEALTHY, NodeState.EJECTED, NodeState.QUARANTINED):
            # An honest restart: back at once (announced even when quick enough never to leave HEALTHY).
            self._set(record, NodeState.HEALTHY, "restarted (new boot id)", announce=True)
        elif record.state in (NodeState.PENDING, NodeState.IGNORED):
            record.proven = True
            self._set(record, NodeState.HEALTHY, "ok")
        return record

    def _refusal(self, ident: NodeIdentity) -> str | None:
        fam = self.family
        if ident.protocol_version != PROTOCOL_VERSION:
            return f"protocol v{ident.protocol_version}, coordinator speaks v{PROTOCOL_VERSION}"
        if ident.family_id != fam.family_id:
            return f"family {ident.family_id}, not ours ({fam.family_id})"
        if (ident.tokens, ident.dim) != (fam.tokens, fam.dim) or not 0 <= ident.block < fam.depth:
            return f"shape (T={ident.tokens}, D={ident.dim}, block {ident.block}) does not fit the family"
        if fam.generative and ident.stream_limits is None:
            return "no stream limits in its Info: a decoder family's node must serve Decode"
        expected = fam.known_weights.get((ident.model_id, ident.block))
        if expected is None and fam.strict:
            return f"model {ident.model_id} is listed by no known manifest (strict: --model-dir/--family-dir only)"
        if expected is not None and expected != ident.weights_sha256:
            return "weights sha256 differs from the family manifest"
        return None

    # --- liveness ----------------------------------------------------------------------------------------

    def record_success(self, address: str, latency_ms: float) -> None:
        record = self.nodes.get(address)
        if record is None:
            return
        record.served += 1
        record.consecutive_failures = 0
        record.ewma_ms = ewma(record.ewma_ms, latency_ms, self.EWMA_ALPHA)
        record.recent_ms.append(latency_ms)
        if record.state is NodeState.EJECTED:
            self._set(record, NodeState.HEALTHY, "recovered")

    def record_failure(self, address: str, reason: str) -> None:
        record = self.nodes.get(address)
        if record is None:
            return
        record.failed += 1
        record.consecutive_failures += 1
        if record.state is NodeState.HEALTHY and record.consecutive_failures >= self.eject_after:
            self._set(record, NodeState.EJECTED, reason)

    def eject(self, address: str, reason: str) -> None:
        record = self.nodes.get(address)
        if record is not None and record.state is NodeState.HEALTHY:
            self._set(record, NodeState.EJECTED, reason)

    def refuse(self, address: str, reason: str) -> None:
        """A node that will not let us in (wrong token): listed, never routed to."""
        record = self.nodes.get(address)
        if record is not None:
            self._set(record, NodeState.IGNORED, reason)

    def quarantine(self, address: str, reason: str, evidence: Evidence | None = None) -> None:
        record = self.nodes.get(address)
        if record is not None and record.state is not NodeState.IGNORED:
            record.failed += 1
            if evidence is not None:
                record.evidence.append(evidence)
                record.convicted = True
                if record.identity is not None:
                    self.convictions.convict(address, record.identity.boot_id)
            self._set(record, NodeState.QUARANTINED, reason)

    def health_ok(self, address: str) -> None:
        record = self.nodes.get(address)
        if record is None or record.identity is None:
            return
        record.consecutive_failures = 0
        if record.state is NodeState.EJECTED:
            self._set(record, NodeState.HEALTHY, "recovered")
        elif record.state is not NodeState.QUARANTINED or record.convicted:
            return  # routable already, or this incarnation was caught lying: it never comes back
        elif self._contest_of(record.identity) is not None:
            return  # its weights are contested: no replica of them is routed to until that ends
        elif record.barred:
            if self.convictions.bar(address, record.identity.boot_id) is None:
                record.barred = False
                self._set(record, NodeState.HEALTHY, "conviction cool-down over: a new incarnation, on probation")
        elif self.clock() - record.state_since >= self.quarantine_s:
            self._set(record, NodeState.HEALTHY, "quarantine over")

    def health_failed(self, address: str, reason: str) -> None:
        record = self.nodes.get(address)
        if record is None:
            return
        record.consecutive_failures += 1
        if record.state is NodeState.PENDING:
            record.reason = reason  # why it cannot be admitted yet (unreachable, TLS handshake, ...)
        if record.state is NodeState.HEALTHY and record.consecutive_failures >= self.eject_after:
            self._set(record, NodeState.EJECTED, reason)

    def _set(self, record: NodeRecord, state: NodeState, reason: str, announce: bool = False) -> None:
        """`announce`: report it even when the state stays (a convicted node back with a new boot id)."""
        old = record.state
        if old is not state:
            record.state_since = self.clock()
        record.state, record.reason = state, reason
        if old is not state or announce:
            self._emit(NodeEvent(record.address, old, state, reason))

    def _emit(self, event: NodeEvent) -> None:
        if self.on_change is not None:
            self.on_change(event)

    # --- contested weights ----------------------------------------------------------------------------------

    def contest(self, key: WeightsKey, reason: str, duration_s: float) -> None:
        """Replicas of these weights disagreed and nobody can say who is right: route to none of them for
        `duration_s` (each new disagreement starts it again). Nobody is convicted or counted as failed."""
        self.contested[key] = Contest(self.clock() + duration_s, reason)
        for record in self.nodes.values():
            ident = record.identity
            if ident is not None and weights_key(ident) == key and record.state is NodeState.HEALTHY:
                self._set(record, NodeState.QUARANTINED, reason)

    def _contest_of(self, identity: NodeIdentity) -> Contest | None:
        contest = self.contested.get(weights_key(identity))
        if contest is None:
            return None
        if self.clock() >= contest.until:
            del self.contested[weights_key(identity)]
            return None
        return contest

    def contested_view(self) -> list[ContestView]:
        """For /v1/nodes: contested weights, why, and until when (Unix seconds)."""
        now, wall = self.clock(), self.wall()
        return [
            {
                "model_id": model_id,
                "block": block,
                "weights_sha256": sha,
                "reason": contest.reason,
                "until": round(wall + contest.until - now, 1),
            }
            for (model_id, block, sha), contest in self.contested.items()
            if contest.until > now
        ]

    # --- views -------------------------------------------------------------------------------------------

    def routable_by_block(self) -> dict[int, list[NodeRecord]]:
        by_block: dict[int, list[NodeRecord]] = {}
        for record in self.nodes.values():
            if record.routable:
                by_block.setdefault(record.block, []).append(record)
        return by_block

    def reachable_depth(self) -> int:
        return len(self.routable_by_block())

    def snapshot(self) -> list[NodeView]:
        ordered = sorted(self.nodes.values(), key=lambda r: (r.block, r.address))
        return [self.view(r) for r in ordered]

    def view(self, record: NodeRecord) -> NodeView:
        address = record.address
        return {
            **record.to_json(),
            **self.convictions.view(address, self.wall),
            **self.claims.view(address, self.wall),
            "links": self.links.from_node(address),
        }
