"""The last node's outbox (node/outbox.py): every run of a request's last step kept, a few at most,
until they expire; found first-come or by digest; nothing a Collect does can push a result out."""

from __future__ import annotations

import asyncio

import pytest

from layerswarm.node import outbox as outbox_module
from layerswarm.node.outbox import PER_REQUEST, Outbox, OutboxFull
from layerswarm.wire.relay_plan import digest
from layerswarm.wire.v1 import block_pb2 as pb


def result(data: bytes) -> pb.ForwardResponse:
    return pb.ForwardResponse(activations=pb.Tensor(data=data))


async def test_a_take_by_digest_finds_the_chains_run_behind_a_racers_and_nothing_is_taken_away() -> None:
    """Any token holder may Collect: a take that removed its result let a node of the chain take the
    chain's result before the coordinator's collect by digest."""
    box = Outbox()
    box.put("r", result(b"raced"))
    box.put("r", result(b"chain"))
    assert (await box.take("r", 0.1)).activations.data == b"raced"  # type: ignore[union-attr]
    for _ in range(2):  # a thief's take first, then ours: both get it
        assert (await box.take("r", 0.1, digest(b"chain"))).activations.data == b"chain"  # type: ignore[union-attr]


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


async def test_collects_for_made_up_ids_push_nothing_out_and_their_waiting_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A take made a slot for any request id, so a flood of Collects for made-up ids evicted the chain's
    own slot (and the last two nodes were failed for the result they could not serve)."""
    monkeypatch.setattr(outbox_module, "MAX_WAITING", 3)
    box = Outbox()
    box.put("chain", result(b"x"))
    junk = [asyncio.ensure_future(box.take(f"junk-{i}", 5.0)) for i in range(3 + outbox_module.MAX_RESULTS)]
    await asyncio.sleep(0.01)
    assert await box.take("late", 5.0) is None  # the waiting places are full: refused at once, not at 5 s
    assert (await box.take("chain", 0.01)) is not None  # a kept result is found without waiting
    for task in junk:
        task.cancel()
    await asyncio.gather(*junk, return_exceptions=True)


async def test_a_full_outbox_refuses_new_runs_and_keeps_what_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicting the oldest let a node replaying old chains push out the result a last node had just
    signed for (and the last node was failed for not serving it): a run past the bound is refused."""
    monkeypatch.setattr(outbox_module, "MAX_RESULTS", 4)
    box = Outbox()
    for i in range(4):
        box.reserve(f"r{i}")
        box.put(f"r{i}", result(b"x"))
    with pytest.raises(OutboxFull, match="outbox full"):
        box.reserve("r4")
    assert all([await box.take(f"r{i}", 0.01) is not None for i in range(4)])
    monkeypatch.setattr(outbox_module, "TTL_S", 0.0)  # once they expire, room again
    box.reserve("r4")
