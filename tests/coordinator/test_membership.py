"""Membership from proof, not hints: the registry's rules (pure logic, fake clock), background loops
that survive errors, the logged state changes, and a coordinator restart that answers at once."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, Policy
from layerswarm.coordinator.membership.peer_memory import load_peers, save_peers
from layerswarm.coordinator.membership.records import FamilySpec, NodeEvent, NodeState
from layerswarm.coordinator.membership.registry import Registry
from layerswarm.harness.netns import in_private_netns, loopback_multicast_ready
from layerswarm.node.server import Node
from layerswarm.node.settings import NodeSettings
from layerswarm.wire.auth import AuthError, ReplayCache
from layerswarm.wire.periodic import Periodic

from ..swarm import states, wait_until
from .test_routing import Clock, ident

FAMILY = FamilySpec("fam-a", depth=4, tokens=5, dim=8)


def registry(clock: Clock | None = None, **kw: int) -> tuple[Registry, list[NodeEvent]]:
    events: list[NodeEvent] = []
    reg = Registry(FAMILY, eject_after=2, quarantine_s=10.0, clock=clock or Clock(), on_change=events.append, **kw)
    return reg, events


def test_hints_never_change_a_proven_nodes_state() -> None:
    reg, events = registry()
    reg.add_candidate("10.0.0.1:1", "mdns", "fam-a", hint="mdns:real")
    reg.admit("10.0.0.1:1", ident(0, family="fam-a"))
    assert reg.nodes["10.0.0.1:1"].state is NodeState.HEALTHY
    events.clear()
    reg.add_candidate("10.0.0.1:1", "mdns", "fam-evil", hint="mdns:forged")  # a forged re-advert
    assert not reg.drop_hint("10.0.0.1:1", "mdns:forged")  # its goodbye: another hint remains
    assert reg.drop_hint("10.0.0.1:1", "mdns:real")  # the last hint gone: the caller must verify
    assert reg.nodes["10.0.0.1:1"].state is NodeState.HEALTHY and events == []
    reg.add_candidate("10.0.0.1:1", "static")
    reg.forget("10.0.0.1:1", "gone")  # a node with a hint is never forgotten
    assert "10.0.0.1:1" in reg.nodes
    reg.drop_hint("10.0.0.1:1", "static")
    reg.forget("10.0.0.1:1", "no hint and no answer")
    assert "10.0.0.1:1" not in reg.nodes
    assert events == [NodeEvent("10.0.0.1:1", NodeState.HEALTHY, None, "no hint and no answer")]


def test_a_stranger_is_left_alone_until_a_hint_vouches_for_it() -> None:
    reg, _ = registry()
    record = reg.add_candidate("10.0.0.2:1", "mdns", "fam-b", hint="mdns:x")
    assert record is not None and record.state is NodeState.IGNORED and "not contacted" in record.reason
    assert not record.worth_contacting("fam-a")
    reg.add_candidate("10.0.0.2:1", "mdns", "fam-a", hint="mdns:y")
    assert record.state is NodeState.PENDING and record.worth_contacting("fam-a")
    reg.add_candidate("10.0.0.2:1", "mdns", "fam-b", hint="mdns:y")  # an advert flips nothing back
    assert record.state is NodeState.PENDING


def test_unproven_mdns_candidates_are_bounded() -> None:
    clock = Clock()
    reg, events = registry(clock, max_unproven=4, max_unproven_per_host=2)
    for i in range(2):
        clock.now += 1
        assert reg.add_candidate(f"10.0.0.1:{i}", "mdns", "fam-a", hint=f"mdns:{i}") is not None
    assert reg.add_candidate("10.0.0.1:9", "mdns", "fam-a", hint="mdns:9") is None  # host full, none failed
    reg.health_failed("10.0.0.1:0", "unreachable")
    assert reg.add_candidate("10.0.0.1:9", "mdns", "fam-a", hint="mdns:9") is not None  # the failed one made room
    assert "10.0.0.1:0" not in reg.nodes and events[-1].new is None
    for i in range(2, 4):
        assert reg.add_candidate(f"10.0.{i}.1:1", "mdns", "fam-a", hint=f"mdns:{i}") is not None
    assert reg.add_candidate("10.0.9.1:1", "mdns", "fam-a", hint="mdns:new") is None  # all full
    assert reg.add_candidate("10.0.9.1:1", "static") is not None  # an operator's peer is never bounded
    reg.admit("10.0.2.1:1", ident(0, family="fam-a"))  # proven nodes do not count
    assert reg.add_candidate("10.0.8.1:1", "mdns", "fam-a", hint="mdns:late") is not None
    for i in range(20):  # many names for one address keep only the newest few
        reg.add_candidate("10.0.2.1:1", "mdns", "fam-a", hint=f"mdns:alias-{i}")
    assert len(reg.nodes["10.0.2.1:1"].hints) == Registry.MAX_MDNS_HINTS


def test_every_state_change_is_an_event_with_its_reason() -> None:
    clock = Clock()
    reg, events = registry(clock)
    reg.admit("a:1", ident(0, family="fam-a"))
    reg.record_failure("a:1", "timeout")
    reg.record_failure("a:1", "timeout")
    reg.health_ok("a:1")
    reg.quarantine("a:1", "NaN activations")
    clock.now += 11
    reg.health_ok("a:1")
    reg.refuse("a:1", "no proof")
    assert [(e.old, e.new, e.reason) for e in events] == [
        (NodeState.PENDING, NodeState.HEALTHY, "ok"),
        (NodeState.HEALTHY, NodeState.EJECTED, "timeout"),
        (NodeState.EJECTED, NodeState.HEALTHY, "recovered"),
        (NodeState.HEALTHY, NodeState.QUARANTINED, "NaN activations"),
        (NodeState.QUARANTINED, NodeState.HEALTHY, "quarantine over"),
        (NodeState.HEALTHY, NodeState.IGNORED, "no proof"),
    ]


async def test_a_background_loop_survives_any_error(caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls % 2:
            raise KeyError("a bug")

    loop = Periodic("flaky", 0.01, flaky)
    with caplog.at_level(logging.ERROR):
        loop.start()
        await wait_until(lambda: loop.rounds >= 3, timeout=5, what="rounds after errors")
        await loop.stop()
    assert loop.errors >= 3
    assert "background loop flaky: round failed" in caplog.text and "KeyError" in caplog.text


def test_replay_cache_is_bounded_and_never_reopens() -> None:
    cache = ReplayCache(window_s=60, max_entries=3)
    now = 1_000_000
    for i in range(3):
        cache.admit(f"nonce-{i}", now + i, now)
    with pytest.raises(AuthError, match="replayed"):
        cache.admit("nonce-1", now + 1, now)
    cache.admit("nonce-3", now + 3, now)  # full: the oldest goes, and its time becomes the floor
    assert len(cache) == 3
    with pytest.raises(AuthError, match="older than"):
        cache.admit("nonce-0", now, now)  # the evicted nonce cannot come back
    with pytest.raises(AuthError, match="outside the window"):
        cache.admit("nonce-9", now - 61_000, now)


def test_peer_memory_is_atomic_and_only_a_hint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state" / "peers.json"
    save_peers(path, "fam-a", ["10.0.0.2:50051", "10.0.0.1:50051"])
    assert load_peers(path, "fam-a") == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert [p.name for p in path.parent.iterdir()] == ["peers.json"]  # no temp file left behind
    assert load_peers(path, "fam-b") == []  # another family's memory
    for body in ("{torn", json.dumps({"version": 1, "family_id": "fam-a", "peers": ["x; rm -rf /"]}), "[]"):
        path.write_text(body)
        with caplog.at_level(logging.WARNING):
            assert load_peers(path, "fam-a") == []
    assert "ignoring peer state file" in caplog.text
    assert load_peers(tmp_path / "missing.json", "fam-a") == []


async def test_a_restarted_coordinator_remembers_its_peers_and_answers_at_once(model_dir: Path, tmp_path: Path) -> None:
    node = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.1))
    await node.start()
    address, state_file = f"127.0.0.1:{node.port}", tmp_path / "coordinator.json"
    try:
        first = Coordinator(
            CoordinatorSettings(model_dir=model_dir, peers=(address,), mdns=False, state_file=state_file)
        )
        await first.start()
        await wait_until(lambda: states(first).get(address) == "healthy", what="admitted")
        await first.stop()
        assert load_peers(state_file, first.registry.family.family_id) == [address]
        again = Coordinator(CoordinatorSettings(model_dir=model_dir, mdns=False, state_file=state_file))
        assert again.ready() == (False, "starting: the first discovery and health round is not complete")
        await again.start()
        try:  # no static peer, no discovery: only the memory, verified, leads it to the node
            result = await again.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL))
            assert [h.outcome for h in result.path.hops] == ["ok"]
            assert again.registry.nodes[address].source == "remembered"
            assert again.ready()[0]
        finally:
            await again.stop()
    finally:
        await node.stop()


async def test_a_remembered_peer_that_never_answers_is_forgotten(model_dir: Path, tmp_path: Path) -> None:
    """A peer state file from an earlier run (another LAN) must not leave a pending node checked forever;
    a static peer that does not answer is kept (the operator named it)."""
    from layerswarm.coordinator.membership.health import REMEMBERED_TRIES

    state_file, gone, static = tmp_path / "coordinator.json", "127.0.0.1:9", "127.0.0.1:7"  # nothing listens
    coord = Coordinator(CoordinatorSettings(model_dir=model_dir, mdns=False, peers=(static,), state_file=state_file))
    save_peers(state_file, coord.registry.family.family_id, [gone])
    await coord.start()
    try:
        assert coord.registry.nodes[gone].source == "remembered"
        for _ in range(REMEMBERED_TRIES):
            await coord.watch.monitor.check_all()
        assert gone not in coord.registry.nodes and static in coord.registry.nodes
    finally:
        await coord.stop()


@pytest.mark.skipif(
    not (in_private_netns() and loopback_multicast_ready()), reason="mDNS: run inside a private namespace"
)
async def test_classify_right_after_start_waits_for_discovery(family_dirs: list[Path]) -> None:
    nodes = [Node(NodeSettings(model_dir=family_dirs[0], block=b, grace_s=0.1)) for b in range(3)]
    for n in nodes:
        await n.start()
    for n in nodes:  # the nodes were there before the coordinator (re)started: on the LAN already
        assert n.advertiser is not None
        await n.advertiser.announced()
    settings = CoordinatorSettings(
        model_dir=family_dirs[0], health_interval_s=0.2, min_blocks=3, mdns_settle_s=3.0, startup_wait_s=8.0
    )  # generous: this tests the waiting, on 2 busy cores
    coord = Coordinator(settings)
    try:
        await coord.start()
        result = await coord.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL))
        assert len(result.path.hops) == 3  # not a 503 for a swarm that is there
        assert coord.ready()[0]
    finally:
        await coord.stop()
        await asyncio.gather(*(n.stop() for n in nodes))


async def test_node_state_changes_are_logged(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(NodeSettings(model_dir=model_dir, block=0, advertise=False, grace_s=0.1))
    await node.start()
    address = f"127.0.0.1:{node.port}"
    coord = Coordinator(CoordinatorSettings(model_dir=model_dir, peers=(address,), mdns=False, health_interval_s=0.1))
    with caplog.at_level(logging.INFO, logger="layerswarm.coordinator.process"):
        await coord.start()
        await wait_until(lambda: states(coord).get(address) == "healthy", what="admitted")
        await node.stop()
        await wait_until(lambda: states(coord).get(address) == "ejected", what="ejected")
        await coord.stop()
    assert f"node {address}: pending -> healthy (ok)" in caplog.text
    assert any(r.levelno == logging.WARNING and "-> ejected (" in r.message for r in caplog.records)


async def test_an_unwritable_state_file_warns_once(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("")
    coord = Coordinator(CoordinatorSettings(model_dir=model_dir, mdns=False, state_file=tmp_path / "a-file" / "p.json"))
    coord.registry.admit("10.0.0.1:1", ident(0, family=coord.registry.family.family_id, depth=3, tokens=5, dim=32))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            await coord.watch.memory.run_once()
    assert caplog.text.count("cannot write peer state file") == 1 and coord.watch.memory.errors == 0
