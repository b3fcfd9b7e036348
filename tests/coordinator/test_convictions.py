"""A conviction outlives the incarnation it caught: the boot id is the node's own claim, so claiming a
new one must not bring a liar back before its cool-down (pure registry logic, fake clock)."""

from __future__ import annotations

from typing import Any

from layerswarm.coordinator.membership.records import FamilySpec, NodeEvent, NodeState
from layerswarm.coordinator.membership.registry import Registry

from .test_routing import Clock, ident

FAMILY = FamilySpec("fam-a", depth=4, tokens=5, dim=8)
LIAR = "10.0.0.1:7001"
EVIDENCE = {"check": "re-execution", "discrepancy": "relative RMS error 1"}


def registry(clock: Clock, **kw: Any) -> tuple[Registry, list[NodeEvent]]:
    events: list[NodeEvent] = []
    reg = Registry(FAMILY, eject_after=2, quarantine_s=10.0, clock=clock, on_change=events.append, **kw)
    return reg, events


def convict(reg: Registry, address: str = LIAR, boot: str = "boot-1") -> None:
    """Admit `address` as incarnation `boot` and catch it lying."""
    reg.admit(address, ident(0, boot=boot))
    reg.health_ok(address)
    reg.quarantine(address, "verification failed: re-execution", dict(EVIDENCE))


def come_back(reg: Registry, boot: str, address: str = LIAR) -> NodeState:
    """What a health round does with a node that answers Info as `boot` and says SERVING."""
    reg.admit(address, ident(0, boot=boot))
    reg.health_ok(address)
    return reg.nodes[address].state


def test_a_convicted_node_claiming_a_new_boot_id_stays_quarantined() -> None:
    clock = Clock()
    reg, events = registry(clock)  # the default cool-down: minutes, not seconds
    convict(reg)
    clock.now += 60
    assert come_back(reg, "boot-2") is NodeState.QUARANTINED
    record = reg.nodes[LIAR]
    assert "convicted" in record.reason and "new boot id" in record.reason
    assert record.identity is not None and record.identity.boot_id == "boot-2"  # listed as what it claims
    clock.now += 60  # the quarantine's own 10 s are long over: a conviction is not a quarantine
    assert come_back(reg, "boot-3") is NodeState.QUARANTINED
    assert not reg.routable_by_block()
    # The operator sees each refused comeback (same state, so no transition is counted for it).
    refused = [e for e in events if e.old is e.new is NodeState.QUARANTINED]
    assert len(refused) == 2 and all("new boot id" in e.reason for e in refused)


def test_after_the_cool_down_a_new_incarnation_is_back_on_probation() -> None:
    clock = Clock()
    reg, events = registry(clock, conviction_cooldown_s=100.0)
    convict(reg)
    clock.now += 50
    assert come_back(reg, "boot-2") is NodeState.QUARANTINED
    clock.now += 49
    assert come_back(reg, "boot-2") is NodeState.QUARANTINED
    clock.now += 1
    assert come_back(reg, "boot-2") is NodeState.HEALTHY
    assert events[-1].new is NodeState.HEALTHY and "cool-down" in events[-1].reason
    record = reg.nodes[LIAR]
    assert not record.convicted and record.ewma_ms is None  # a fresh incarnation (verify.py: on probation)


def test_the_convicted_incarnation_itself_never_comes_back() -> None:
    clock = Clock()
    reg, _ = registry(clock, conviction_cooldown_s=100.0)
    convict(reg)
    clock.now += 1_000
    assert come_back(reg, "boot-1") is NodeState.QUARANTINED


def test_each_further_conviction_doubles_the_cool_down_up_to_a_cap() -> None:
    clock = Clock()
    reg, _ = registry(clock, conviction_cooldown_s=100.0, conviction_max_cooldown_s=350.0)
    convict(reg)
    clock.now += 100
    assert come_back(reg, "boot-2") is NodeState.HEALTHY
    reg.quarantine(LIAR, "verification failed", dict(EVIDENCE))  # caught again: 200 s this time
    clock.now += 199
    assert come_back(reg, "boot-3") is NodeState.QUARANTINED
    clock.now += 1
    assert come_back(reg, "boot-3") is NodeState.HEALTHY
    reg.quarantine(LIAR, "verification failed", dict(EVIDENCE))  # 400 s, capped at 350
    clock.now += 349
    assert come_back(reg, "boot-4") is NodeState.QUARANTINED
    clock.now += 1
    assert come_back(reg, "boot-4") is NodeState.HEALTHY
    assert reg.snapshot()[0]["convictions"] == 3


def test_one_incarnation_caught_on_several_hops_at_once_is_one_conviction() -> None:
    clock = Clock()
    reg, _ = registry(clock, conviction_cooldown_s=100.0)
    convict(reg)
    for _ in range(3):  # hops that were in flight when it was caught
        reg.quarantine(LIAR, "verification failed", dict(EVIDENCE))
    clock.now += 100
    assert come_back(reg, "boot-2") is NodeState.HEALTHY
    assert reg.snapshot()[0]["convictions"] == 1


def test_an_honest_restart_comes_back_at_once() -> None:
    clock = Clock()
    reg, _ = registry(clock)
    reg.admit(LIAR, ident(0))
    reg.record_failure(LIAR, "UNAVAILABLE")
    reg.record_failure(LIAR, "UNAVAILABLE")
    assert reg.nodes[LIAR].state is NodeState.EJECTED
    assert reg.admit(LIAR, ident(0, boot="boot-2")).state is NodeState.HEALTHY  # crashed and restarted
    reg.quarantine(LIAR, "malformed activations")  # no evidence of a lie: not a conviction
    assert reg.admit(LIAR, ident(0, boot="boot-3")).state is NodeState.HEALTHY
    assert reg.nodes[LIAR].reason == "restarted (new boot id)"
    assert reg.snapshot()[0]["convictions"] == 0 and reg.snapshot()[0]["barred_until"] is None


def test_other_ports_of_the_same_host_are_not_barred() -> None:
    """Many honest nodes share a host (docker-compose): a conviction is one address's, not the host's."""
    clock = Clock()
    reg, _ = registry(clock)
    convict(reg)
    neighbour = "10.0.0.1:7002"
    reg.add_candidate(neighbour, "static")
    assert reg.admit(neighbour, ident(1, boot="boot-9")).state is NodeState.HEALTHY
    assert [r.address for r in reg.routable_by_block()[1]] == [neighbour]


def test_a_forgotten_convict_back_at_its_address_is_still_barred() -> None:
    """Leaving (no hint, no answer) and coming back must not wipe the slate: convictions are not kept
    in the node's record, which is dropped when it is forgotten."""
    clock = Clock()
    reg, _ = registry(clock, conviction_cooldown_s=100.0)
    reg.add_candidate(LIAR, "mdns", "fam-a", hint="mdns:liar")
    convict(reg)
    reg.drop_hint(LIAR, "mdns:liar")
    reg.forget(LIAR, "no longer advertised or listed, and not answering")
    assert LIAR not in reg.nodes
    reg.add_candidate(LIAR, "mdns", "fam-a", hint="mdns:liar-again")
    assert come_back(reg, "boot-2") is NodeState.QUARANTINED
    clock.now += 100
    assert come_back(reg, "boot-2") is NodeState.HEALTHY


def test_the_nodes_view_shows_convictions_and_the_bar() -> None:
    clock = Clock()
    clock.now = 1_000.0
    reg, _ = registry(clock, conviction_cooldown_s=100.0, wall=lambda: 1_700_000_000.0)
    convict(reg)
    clock.now += 30
    come_back(reg, "boot-2")
    view = reg.snapshot()[0]
    assert view["state"] == "quarantined" and view["convictions"] == 1
    assert view["barred_until"] == 1_700_000_070.0  # wall time: 70 s from now
    clock.now += 70
    come_back(reg, "boot-2")
    view = reg.snapshot()[0]
    assert view["state"] == "healthy" and view["convictions"] == 1 and view["barred_until"] is None


def test_remembered_convictions_are_bounded() -> None:
    clock = Clock()
    reg, _ = registry(clock, conviction_cooldown_s=100.0)
    reg.convictions.max_keys = 4
    for port in range(10):
        clock.now += 1
        convict(reg, f"10.0.0.2:{port}")
    assert len(reg.convictions) == 4
    assert reg.nodes["10.0.0.2:9"].state is NodeState.QUARANTINED
