"""The last node's outbox (node/outbox.py): every run of a request's last step kept, a few at most,
taken first-come or by digest, bounded in all."""

from __future__ import annotations

import asyncio

import pytest

from layerswarm.node import outbox as outbox_module
from layerswarm.node.outbox import PER_REQUEST, Outbox, OutboxFull
from layerswarm.wire.relay_plan import digest
from layerswarm.wire.v1 import block_pb2 as pb


def result(data: bytes) -> pb.ForwardResponse:
    return pb.ForwardResponse(activations=pb.Tensor(data=data))


async def test_a_take_by_digest_finds_the_chains_run_behind_a_racers() -> None:
    box = Outbox()
    box.put("r", result(b"raced"))
    box.put("r", result(b"chain"))
    assert (await box.take("r", 0.1)).activations.data == b"raced"  # type: ignore[union-attr]
    assert (await box.take("r", 0.1, digest(b"chain"))).activations.data == b"chain"  # type: ignore[union-attr]
    assert await box.take("r", 0.01, digest(b"chain")) is None  # taken: not kept


async def test_a_take_waits_for_its_result_and_one_by_digest_only_for_that_one() -> None:
    box = Outbox()
    first = asyncio.ensure_future(box.take("r", 2.0))
    signed = asyncio.ensure_future(box.take("r", 2.0, digest(b"chain")))
    await asyncio.sleep(0.01)
    box.put("r", result(b"raced"))
    assert (await first).activations.data == b"raced"  # type: ignore[union-attr]
    await asyncio.sleep(0.01)
    assert not signed.done()  # the raced result is not the one it waits for
    box.put("r", result(b"chain"))
    assert (await signed).activations.data == b"chain"  # type: ignore[union-attr]


async def test_runs_past_the_share_of_a_request_are_refused_before_they_compute() -> None:
    box = Outbox()
    for _ in range(PER_REQUEST):
        box.reserve("r")
    with pytest.raises(OutboxFull):
        box.reserve("r")
    box.reserve("another")  # per request id


async def test_the_outbox_is_bounded_and_an_evicted_requests_take_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outbox_module, "MAX_RESULTS", 4)
    box = Outbox()
    waiting = asyncio.ensure_future(box.take("old", 5.0, digest(b"never")))
    await asyncio.sleep(0.01)
    for i in range(5):
        box.put(f"r{i}", result(b"x"))
    assert await asyncio.wait_for(waiting, 1.0) is None  # woken when its request id went, not at 5 s
    assert await box.take("r0", 0.01) is None  # the oldest results went first
    assert await box.take("r4", 0.01) is not None
