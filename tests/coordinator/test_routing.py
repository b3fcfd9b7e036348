"""Registry and planner: pure logic, no sockets."""

from __future__ import annotations

import dataclasses
import random

import pytest

from layerswarm.coordinator.membership.records import FamilySpec, NodeIdentity, NodeState
from layerswarm.coordinator.membership.registry import Registry
from layerswarm.coordinator.routing.planner import Policy, plan_path, substitutes

FAMILY = FamilySpec("fam-a", depth=4, tokens=5, dim=8, known_weights={("mdl-1", 0): "sha-good"})


def ident(
    block: int, model: str = "mdl-1", family: str = "fam-a", sha: str = "sha-good", boot: str = "boot-1", **kw: object
) -> NodeIdentity:
    base = {
        "family_id": family,
        "model_id": model,
        "block": block,
        "variant": "layershuffle",
        "weights_sha256": sha,
        "boot_id": boot,
        "protocol_version": 1,
        "depth": 4,
        "tokens": 5,
        "dim": 8,
        "shuffle_robust": True,
    }
    return NodeIdentity(**{**base, **kw})  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def registry_with(*identities: NodeIdentity, clock: Clock | None = None) -> Registry:
    reg = Registry(FAMILY, eject_after=2, quarantine_s=10.0, clock=clock or Clock())
    for i, identity in enumerate(identities):
        reg.admit(f"10.0.0.{i}:1", identity)
    return reg


def test_admission_and_refusals() -> None:
    reg = registry_with(
        ident(0),
        ident(1, family="fam-b"),
        ident(0, sha="sha-evil"),
        ident(2, protocol_version=9),
        ident(3, dim=16),
        ident(9),
    )
    states = {a: (r.state, r.reason) for a, r in reg.nodes.items()}
    assert states["10.0.0.0:1"][0] is NodeState.HEALTHY
    assert states["10.0.0.1:1"] == (NodeState.IGNORED, "family fam-b, not ours (fam-a)")
    assert "sha256 differs" in states["10.0.0.2:1"][1]
    assert "protocol v9" in states["10.0.0.3:1"][1]
    assert "does not fit" in states["10.0.0.4:1"][1] and "does not fit" in states["10.0.0.5:1"][1]
    assert reg.reachable_depth() == 1


def test_advertised_foreign_family_is_ignored_before_any_call() -> None:
    reg = registry_with()
    record = reg.add_candidate("10.0.0.9:1", "mdns", advert_family="fam-z")
    assert record.state is NodeState.IGNORED and "fam-z" in record.reason


def test_eject_after_failures_and_readmit_on_recovery() -> None:
    reg = registry_with(ident(0))
    reg.record_failure("10.0.0.0:1", "UNAVAILABLE")
    assert reg.nodes["10.0.0.0:1"].state is NodeState.HEALTHY  # one failure is not enough
    reg.record_failure("10.0.0.0:1", "UNAVAILABLE")
    assert reg.nodes["10.0.0.0:1"].state is NodeState.EJECTED and reg.reachable_depth() == 0
    reg.health_ok("10.0.0.0:1")
    assert reg.nodes["10.0.0.0:1"].state is NodeState.HEALTHY


def test_quarantine_lasts_its_cool_down() -> None:
    clock = Clock()
    reg = registry_with(ident(0), clock=clock)
    reg.quarantine("10.0.0.0:1", "NaN")
    reg.health_ok("10.0.0.0:1")
    assert reg.nodes["10.0.0.0:1"].state is NodeState.QUARANTINED
    clock.now = 11.0
    reg.health_ok("10.0.0.0:1")
    assert reg.nodes["10.0.0.0:1"].state is NodeState.HEALTHY


def test_new_incarnation_resets_statistics() -> None:
    reg = registry_with(ident(0))
    reg.record_success("10.0.0.0:1", 50.0)
    reg.admit("10.0.0.0:1", ident(0, boot="boot-2"))
    assert reg.nodes["10.0.0.0:1"].ewma_ms is None


def test_sequential_plan_uses_each_block_once_in_order_and_prefers_own_model() -> None:
    reg = registry_with(ident(0, model="mdl-2"), ident(0), ident(1), ident(3))
    plan = plan_path(Policy.SEQUENTIAL, reg.routable_by_block(), 4, random.Random(0), preferred_model="mdl-1")
    assert [s.block for s in plan.steps] == [0, 1, 3] and plan.unreachable == [2]
    assert plan.steps[0].candidates[0].identity.model_id == "mdl-1"  # type: ignore[union-attr]
    assert len(plan.steps[0].candidates) == 2  # a sibling model stands by to substitute


def test_shuffle_plans_are_permutations_and_vary() -> None:
    reg = registry_with(*(ident(b) for b in range(4)))
    rng = random.Random(1)
    orders = {
        tuple(s.block for s in plan_path(Policy.SHUFFLE, reg.routable_by_block(), 4, rng).steps) for _ in range(30)
    }
    assert len(orders) > 5 and all(sorted(o) == [0, 1, 2, 3] for o in orders)
    pruned = plan_path(Policy.SHUFFLE, reg.routable_by_block(), 4, rng, max_blocks=2)
    assert len(pruned.steps) == 2 and len({s.block for s in pruned.steps}) == 2


def test_fastest_ranks_by_latency_and_load() -> None:
    reg = registry_with(ident(0), ident(0, model="mdl-2"))
    reg.record_success("10.0.0.0:1", 30.0)
    reg.record_success("10.0.0.1:1", 5.0)
    plan = plan_path(Policy.FASTEST, reg.routable_by_block(), 4, random.Random(0))
    assert plan.steps[0].candidates[0].address == "10.0.0.1:1"
    for _ in range(10):
        reg.nodes["10.0.0.1:1"].begin_call()
    plan = plan_path(Policy.FASTEST, reg.routable_by_block(), 4, random.Random(0))
    assert plan.steps[0].candidates[0].address == "10.0.0.0:1"


@pytest.mark.parametrize(
    ("k", "expected"), [(1, [0]), (2, [0, 7]), (3, [0, 4, 7]), (4, [0, 2, 5, 7]), (8, list(range(8)))]
)
def test_pruned_sequential_paths_spread_over_the_depth(k: int, expected: list[int]) -> None:
    """k of 8 blocks: first and last kept, the rest evenly between, in order; the evaluation's pruned
    figures use the same rule (one function), so the swarm delivers what the evaluation measured."""
    from layerswarm.models.paths import spread_evenly

    reg = Registry(dataclasses.replace(FAMILY, depth=8), eject_after=2, quarantine_s=10.0, clock=Clock())
    for b in range(8):
        reg.admit(f"10.0.0.{b}:1", ident(b, depth=8))
    blocks = [s.block for s in plan_path(Policy.SEQUENTIAL, reg.routable_by_block(), 8, random.Random(0), k).steps]
    assert blocks == expected == spread_evenly(range(8), k)
    without_3 = {b: nodes for b, nodes in reg.routable_by_block().items() if b != 3}
    blocks = [s.block for s in plan_path(Policy.SEQUENTIAL, without_3, 8, random.Random(0), 3).steps]
    assert blocks == [0, 4, 7]  # spread over the blocks present (3 has no node)


def test_substitutes_exclude_used_and_planned_blocks() -> None:
    reg = registry_with(*(ident(b) for b in range(4)))
    spare = substitutes(reg.routable_by_block(), used={0}, planned={1}, rng=random.Random(0), exclude=set())
    assert sorted(b for b, _ in spare) == [2, 3]


async def test_dns_discovery_adds_and_forgets_addresses() -> None:
    from layerswarm.coordinator.membership.discovery import DnsDiscovery

    reg = registry_with()
    verified: list[str] = []
    dns = DnsDiscovery(reg, ("localhost:50077",), verify=verified.append)
    await dns.resolve_all()  # /etc/hosts: no network needed
    assert reg.nodes["127.0.0.1:50077"].source == "dns"
    dns.targets = []
    await dns.resolve_all()  # gone from DNS: a hint lost, so verify now; only the node's silence removes it
    assert reg.nodes["127.0.0.1:50077"].hints == {}
    assert verified == ["127.0.0.1:50077"] * 2
    reg.forget("127.0.0.1:50077", "not answering")
    assert "127.0.0.1:50077" not in reg.nodes
    with pytest.raises(ValueError, match="NAME:PORT"):
        DnsDiscovery(reg, ("no-port",))
