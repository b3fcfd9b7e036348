"""The coordinator's timeout handlers catch what Python 3.10 raises (the Jetson images run 3.10).

On 3.10 `asyncio.wait_for` raises asyncio.TimeoutError, a class of its own; from 3.11 on it is the
builtin TimeoutError. A handler written `except TimeoutError` is right on 3.11 and misses every
timeout on 3.10: the timeout escapes as a crash (a relay route failing with a traceback, a probe task
dying) instead of being counted as one. These tests put 3.10's class in place (`as_on_python_310`)
and drive each handler with it, so they fail on 3.11 too when a handler catches the builtin.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from layerswarm.coordinator import ClassifyOptions, CoordinatorSettings, Policy
from layerswarm.coordinator.membership.clients import ClientPool
from layerswarm.coordinator.membership.records import FamilySpec, NodeIdentity, NodeRecord, NodeState
from layerswarm.coordinator.membership.registry import Registry
from layerswarm.coordinator.membership.watch import SwarmWatch
from layerswarm.coordinator.relay import chains
from layerswarm.coordinator.relay.chains import RelayRunner
from layerswarm.coordinator.relay.handbacks import forward_probe
from layerswarm.coordinator.routing.hop_call import HopCaller, HopFailed
from layerswarm.coordinator.routing.planner import Step
from layerswarm.coordinator.routing.request import Request
from layerswarm.coordinator.routing.wire_choice import WireFormat
from layerswarm.wire import codec
from layerswarm.wire.discovery import PROTOCOL_VERSION
from layerswarm.wire.v1 import block_pb2 as pb

T = TypeVar("T")
FAMILY = FamilySpec("fam", 3, 5, 32)
NODES = ("10.0.0.1:1", "10.0.0.2:2")


class AsyncioTimeoutError(Exception):
    """asyncio.TimeoutError as Python 3.10 defines it: an Exception of its own, not the builtin."""


@pytest.fixture
def as_on_python_310(monkeypatch: pytest.MonkeyPatch) -> type[Exception]:
    """asyncio.TimeoutError is 3.10's class, and asyncio.wait_for raises it past its timeout."""
    real_wait_for = asyncio.wait_for

    async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
        try:
            return await real_wait_for(awaitable, timeout)
        except TimeoutError as exc:  # what 3.11 raises: 3.10 raised its own class
            raise AsyncioTimeoutError() from exc

    monkeypatch.setattr(asyncio, "TimeoutError", AsyncioTimeoutError)
    monkeypatch.setattr(asyncio, "wait_for", wait_for)
    assert not issubclass(asyncio.TimeoutError, TimeoutError)  # the split the handlers must survive
    return AsyncioTimeoutError


class _Client:
    """A node client whose calls named in `timing_out` time out as asyncio.wait_for does on 3.10; its
    other calls never answer (until cancelled)."""

    def __init__(self, *timing_out: str) -> None:
        self.timing_out = timing_out

    async def _call(self, name: str) -> Any:
        if name in self.timing_out:
            raise asyncio.TimeoutError()  # looked up now: 3.10's class under the fixture
        await asyncio.Event().wait()

    async def forward(self, *args: Any) -> Any:
        return await self._call("forward")

    async def relay(self, *args: Any) -> Any:
        return await self._call("relay")

    async def collect(self, *args: Any) -> Any:
        return await self._call("collect")


class _Pool:
    def __init__(self, client: Any) -> None:
        self.client = client

    def get(self, address: str) -> Any:
        return self.client


def _admitted(registry: Registry, address: str, block: int) -> NodeRecord:
    registry.add_candidate(address, "static")
    ident = NodeIdentity(
        "fam", "m", block, "layershuffle", "sha", "boot", PROTOCOL_VERSION, 3, 5, 32, True, trace_key=b"k"
    )
    return registry.admit(address, ident)


async def test_the_first_round_wait_gives_up_with_a_warning(
    as_on_python_310: type[Exception], model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that comes before the first discovery round is done waits for it, bounded: past the
    bound it is answered anyway (with a warning), never failed by the wait's timeout."""
    settings = CoordinatorSettings(model_dir=model_dir, mdns=False)
    watch = SwarmWatch(settings, Registry(FAMILY), ClientPool())
    with caplog.at_level(logging.WARNING):
        await watch.wait_first_round(0.01)  # the round never started: the wait times out
    assert "first discovery round still running" in caplog.text


async def test_a_probe_that_times_out_counts_as_a_failure_of_the_named_node(as_on_python_310: type[Exception]) -> None:
    """A hand-back's probe forwards to the named node; no answer in time is that node's failure (as a
    star hop's timeout is), and the probe answers False: not an exception out of the probe task."""
    registry = Registry(FAMILY, eject_after=1)  # one failure shows its reason: the node is ejected
    record = _admitted(registry, NODES[0], 0)
    probe = forward_probe(registry, _Pool(_Client("forward")), hop_timeout_s=0.5)  # type: ignore[arg-type]
    assert await probe(NODES[0], pb.ForwardRequest(request_id="r-probe")) is False
    assert (record.failed, record.state) == (1, NodeState.EJECTED)
    assert record.reason == "forward after a hand-back: no answer within 0.5 s"


async def test_a_hop_that_times_out_is_a_failed_hop(as_on_python_310: type[Exception]) -> None:
    """A hop with no answer within the hop timeout is a failed hop that says so (the executor then
    tries another node and counts it against this one), not an exception out of the request."""
    registry = Registry(FAMILY)
    record = _admitted(registry, NODES[0], 0)
    runner, _registry, _segment, run = _runner(_Client())
    hops = HopCaller(registry, _Pool(_Client("forward")), runner.wire, hop_timeout_s=0.5)  # type: ignore[arg-type]
    with pytest.raises(HopFailed, match="DEADLINE_EXCEEDED: no answer in time"):
        await hops.forward(record, run.x, 0, run.request, "rid", path_length=1)
    assert record.in_flight == 0  # the call was let go


def _runner(client: Any) -> tuple[RelayRunner, Registry, list[tuple[Step, NodeRecord]], chains._Run]:
    registry = Registry(FAMILY)
    records = [_admitted(registry, address, block) for block, address in enumerate(NODES)]
    wire = WireFormat(torch.float32, codec.TensorSpec((None, 5, 32)))
    runner = RelayRunner(registry, _Pool(client), None, b"k" * 32, wire, hop_timeout_s=0.5)  # type: ignore[arg-type]
    x = torch.zeros(1, 5, 32)
    request = Request(
        options=ClassifyOptions(),
        id="rid",
        inputs=x,
        x=x,
        policy=Policy.SEQUENTIAL,
        seed=0,
        min_blocks=1,
        anytime_min_blocks=1,
        shuffle_robust=False,
        deadline=time.monotonic() + 5.0,
        anytime_deadline=None,
    )
    segment = [(Step(r.block, [r]), r) for r in records]
    return runner, registry, segment, chains._Run(x, request, "rid")


async def test_a_chain_whose_start_times_out_is_not_started_and_its_first_node_failed(
    as_on_python_310: type[Exception],
) -> None:
    """The first node of a chain does not take it in time: the chain did not start (the route goes on
    from the same activations), and the first node's failure is recorded; no exception ends the route."""
    runner, registry, segment, run = _runner(_Client("relay"))
    result = await runner._chain(run, segment, length=2)
    assert result.hops == [] and result.handback == {
        "kind": "not_started",
        "after_step": -1,
        "reason": f"step 0 ({NODES[0]}): timeout",
    }
    assert registry.nodes[NODES[0]].failed == 1 and NODES[0] in run.avoid


async def test_collects_that_time_out_give_no_result(as_on_python_310: type[Exception]) -> None:
    """The chain's Collect, and the second Collect for the result a last node signed, time out: no
    result (the chain is then discarded and the route goes on star), never an exception."""

    async def timed_out() -> pb.ForwardResponse:
        raise asyncio.TimeoutError()

    assert await chains._collected(asyncio.ensure_future(timed_out()), 1.0) is None
    runner, _registry, segment, _run = _runner(_Client("collect"))
    sent = pb.RelayRequest(forward=pb.ForwardRequest(request_id="rid-c1"), hop_timeout_s=0.5)
    assert await runner._collect_signed(segment[-1][1], sent, "0" * 64) is None
