"""bench/relay_floor.py: a token really goes through every bare process in order, both ways."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest

from layerswarm.bench import relay_floor


def test_star_and_chain_carry_the_token_through_every_process_in_order() -> None:
    out = asyncio.run(relay_floor.star_and_chain_ms(4, b"token", 20))
    assert out["hops"] == 4 and out["star_ms"] > 0 and out["chain_ms"] > 0
    assert out["saved_ms"] == pytest.approx(out["star_ms"] - out["chain_ms"], abs=2e-3)


def test_a_chain_that_skips_a_process_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    async def short_chain(self: relay_floor._Swarm, payload: bytes) -> bytes:
        return payload + bytes(relay_floor.CHAIN_STAMP + i for i in range(len(self.procs) - 1))  # the last never saw it

    monkeypatch.setattr(relay_floor._Swarm, "chain_trip", short_chain)
    with pytest.raises(RuntimeError, match="chain: the bytes came back by"):
        asyncio.run(relay_floor.star_and_chain_ms(3, b"token", 5))


def test_a_process_that_never_answers_fails_the_run_instead_of_hanging_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_floor, "START_TIMEOUT_S", 0.2)
    swarm = relay_floor._Swarm(0)
    parent, silent = multiprocessing.Pipe()  # the other end is held open and says nothing
    swarm.pipes = [parent]
    with pytest.raises(RuntimeError, match=r"did not start within 0\.2 s"):
        asyncio.run(swarm.open())
    silent.close()
    asyncio.run(swarm.close())  # nothing was opened: closing is still clean
    assert parent.closed  # and the pipe is closed with the swarm, not left to the garbage collector


def test_a_chain_trip_that_is_really_a_star_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_floor._Swarm, "chain_trip", relay_floor._Swarm.star_trip)  # the client calls each
    with pytest.raises(RuntimeError, match="chain: the bytes came back by"):
        asyncio.run(relay_floor.star_and_chain_ms(3, b"token", 5))


def test_a_process_killed_mid_run_fails_the_run_instead_of_hanging_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_floor, "TRIP_TIMEOUT_S", 1.0)
    real_chain = relay_floor._Swarm.chain_trip
    trips = 0

    async def chain_then_kill(self: relay_floor._Swarm, payload: bytes) -> bytes:
        nonlocal trips
        trips += 1
        if trips == 3:
            self.procs[1].kill()  # a middle process: the last one lives, so Collect alone would wait for ever
            self.procs[1].join(5)
        return await real_chain(self, payload)

    monkeypatch.setattr(relay_floor._Swarm, "chain_trip", chain_then_kill)
    with pytest.raises(RuntimeError, match=r"no reply within 1 s \(processes gone: \[1\]\)|stream ended mid-run"):
        asyncio.run(relay_floor.star_and_chain_ms(3, b"token", 5))
