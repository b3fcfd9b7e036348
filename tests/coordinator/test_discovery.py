"""mDNS discovery for real, only inside private network namespaces (never on a real LAN).

Loopback: nodes and coordinator in one private namespace. LAN: every node its own host (namespace)
on a bridge, discovered by address over multicast, as on a docker-compose network or a home LAN.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, Coordinator, CoordinatorSettings, Policy
from layerswarm.harness.netlab import NetLab
from layerswarm.harness.netns import in_private_netns, loopback_multicast_ready
from layerswarm.harness.procs import node_cmd, spawn_many, stop_all

from ..conftest import make_model_dir
from ..swarm import states, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.mdns]

if not in_private_netns():
    pytest.skip("mDNS tests run only inside a private network namespace: use scripts/test", allow_module_level=True)


@pytest.fixture
def loopback_multicast() -> None:
    if not loopback_multicast_ready():
        pytest.skip("loopback has no multicast route in this namespace (scripts/test sets it up)")


async def test_nodes_are_discovered_and_say_goodbye(
    loopback_multicast: None, family_dirs: list[Path], tmp_path: Path
) -> None:
    stranger = make_model_dir(tmp_path / "stranger", seed=77)
    layout = [(family_dirs[0], 0), (family_dirs[0], 1), (family_dirs[1], 2), (stranger, 0)]
    nodes = spawn_many([(f"n{i}", node_cmd(d, b, "--grace", "0.5")) for i, (d, b) in enumerate(layout)])
    coord = Coordinator(
        CoordinatorSettings(model_dir=family_dirs[0], health_interval_s=0.2, health_timeout_s=0.3, hop_timeout_s=1.0)
    )
    await coord.start()
    try:
        addr = [f"127.0.0.1:{n.ready['port']}" for n in nodes]
        await wait_until(
            lambda: [states(coord).get(a) for a in addr] == ["healthy"] * 3 + ["ignored"],
            what="three nodes healthy and the stranger ignored",
        )
        assert "advertises family" in coord.registry.nodes[addr[3]].reason
        assert all(coord.registry.nodes[a].source == "mdns" for a in addr)
        result = await coord.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL))
        assert [h.block for h in result.path.hops] == [0, 1, 2]
        nodes[1].signal(signal.SIGTERM)  # graceful: drains, then the mDNS goodbye removes it
        await wait_until(lambda: addr[1] not in coord.registry.nodes, what="goodbye")
        await wait_until(lambda: addr[1] not in coord.pool.addresses(), what="its channel closed")
        nodes[2].signal(signal.SIGKILL)  # no goodbye: health checks must eject it
        await wait_until(lambda: states(coord).get(addr[2]) == "ejected", what="ejection without goodbye")
    finally:
        await coord.stop()
        stop_all(nodes)


@pytest.mark.netns
async def test_discovery_across_hosts_on_a_bridge(family_dirs: list[Path]) -> None:
    reason = NetLab.available()
    if reason:
        pytest.skip(reason)
    with NetLab() as lab:
        hosts = [lab.add_host(f"h{b}") for b in range(3)]
        nodes = spawn_many(
            [
                (
                    h.name,
                    h.command(
                        node_cmd(family_dirs[b % 2], b, "--grace", "0.5", "--insecure", host=h.address, port=50051)
                    ),
                )
                for b, h in enumerate(hosts)
            ]
        )
        coord = Coordinator(
            CoordinatorSettings(
                model_dir=family_dirs[0], health_interval_s=0.2, health_timeout_s=0.3, hop_timeout_s=1.0
            )
        )
        await coord.start()
        try:
            expected = {f"{h.address}:50051" for h in hosts}
            await wait_until(
                lambda: {a for a, s in states(coord).items() if s == "healthy"} == expected,
                timeout=20,
                what="every host discovered by its own address",
            )
            result = await coord.router.classify(torch.rand(1, 3, 16, 16), ClassifyOptions(policy=Policy.SEQUENTIAL))
            assert [h.node for h in result.path.hops] == [f"{h.address}:50051" for h in hosts]
            hosts[1].link(up=False)  # pull the cable: no goodbye, no RST, just silence
            await wait_until(
                lambda: states(coord).get(f"{hosts[1].address}:50051") == "ejected",
                timeout=20,
                what="ejection of an unplugged host",
            )
            hosts[1].link(up=True)
            await wait_until(
                lambda: states(coord).get(f"{hosts[1].address}:50051") == "healthy",
                timeout=20,
                what="re-admission once plugged back",
            )
        finally:
            await coord.stop()
            stop_all(nodes)
