"""--wire-dtype auto: link costs split into RTT (health probes) and per-byte time, int8 chosen per link
where it pays, and real nodes answering in the dtype each link was given."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, Policy
from layerswarm.coordinator.membership.linkmap import COORDINATOR, LinkMap
from layerswarm.coordinator.routing.wire_choice import FP16, INT8, WireChoice, measure_codec_ms_per_mb, wire_bytes
from layerswarm.harness.procs import Proc, stop_all

from ..swarm import address, coordinator, start_nodes, wait_until


def test_the_probe_rtt_is_taken_off_the_per_byte_cost() -> None:
    links = LinkMap()
    links.observe_rtt(COORDINATOR, "n", 2.0)
    links.observe(COORDINATOR, "n", 1_000_000, 11.0)  # one way: 1 ms fixed (half the RTT) + 10 ms for 1 MB
    assert links.per_mb(COORDINATOR, "n") == pytest.approx(10.0)
    assert links.transfer_ms(COORDINATOR, "n", 500_000) == pytest.approx(1.0 + 5.0)
    assert links.per_mb("n", COORDINATOR) is None  # the probe alone says nothing about throughput


def test_int8_only_where_the_saved_bytes_outweigh_the_codec() -> None:
    choice = WireChoice(codec_ms_per_mb=2.0, dim=768)
    numel = 197 * 768
    assert choice.choose([], numel) is FP16  # nothing measured: the cheap default
    assert choice.choose([None, None], numel) is FP16
    assert choice.choose([80.0, 80.0], numel) is INT8  # 100 Mbit/s: ~80 ms per MB
    assert choice.choose([0.5, 0.5], numel) is FP16  # loopback-fast: the codec costs more than it saves
    assert choice.choose([80.0, None], numel) is INT8  # unmeasured links do not veto a measured slow one
    assert wire_bytes(numel, 768, INT8) == numel + 4 * 197 and wire_bytes(numel, 768, FP16) == 2 * numel


def test_the_codec_cost_is_measured_not_assumed() -> None:
    assert 0 < measure_codec_ms_per_mb(197, 64, reps=3) < 10_000


@pytest.fixture
def nodes(family_dirs: list[Path]) -> Iterator[list[Proc]]:
    procs = start_nodes([(family_dirs[0], b) for b in range(3)])
    yield procs
    stop_all(procs)


async def test_a_slow_link_carries_int8_and_the_fast_ones_fp16(family_dirs: list[Path], nodes: list[Proc]) -> None:
    coord = coordinator(family_dirs[0], nodes, wire_dtype="auto")
    reference = coordinator(family_dirs[0], nodes, wire_dtype="fp16")
    await coord.start()
    await reference.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == 3 and reference.registry.reachable_depth() == 3)
        slow = address(nodes[1])
        # A very slow link (160 kbit/s): the test family's activations are tiny (5 x 32), and for tiny
        # tensors the codec's fixed cost per call is large per byte.
        for src, dst in ((COORDINATOR, slow), (slow, COORDINATOR)):
            for _ in range(20):
                coord.registry.links.observe(src, dst, 1_000, 50.0)
        images = torch.rand(2, 3, 16, 16)
        opts = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0)
        result = await coord.router.classify(images, opts)
        wires = {h.node: h.wire for h in result.path.hops}
        assert wires[slow] == "int8"
        assert {w for n, w in wires.items() if n != slow} == {"fp16"}
        assert all(h.outcome == "ok" for h in result.path.hops)  # the int8 reply passed verification
        expected = (await reference.router.classify(images, opts)).probs
        assert torch.allclose(result.probs, expected, atol=2e-2)
        assert "wire" not in (await reference.router.classify(images, opts)).path.hops[0].to_json()
    finally:
        await coord.stop()
        await reference.stop()
