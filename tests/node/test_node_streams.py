"""The decoder node's stream table (node/streams.py), as pure logic: limits, least-recently-used eviction,
rollback, ownership, the idle timeout and the byte accounting, with real KV caches and a fake clock; and
who a caller is (node/callers.py)."""

from __future__ import annotations

import random

import pytest
import torch

from layerswarm.models.lm.cache import KVCache
from layerswarm.node.callers import caller_of, peer_host
from layerswarm.node.streams import (
    BYTES,
    FAILED_PRECONDITION,
    IDLE,
    NOT_FOUND,
    PERMISSION_DENIED,
    RELEASED,
    RESOURCE_EXHAUSTED,
    SLOTS,
    STREAM_ENDED,
    Caller,
    Limits,
    Stream,
    StreamError,
    StreamTable,
)

BPT = 2 * 1 * 1 * 4  # bytes per token of capacity: keys and values, one head of one float32
FIRST = 16 * BPT  # a cache's first allocation (16 tokens)
ME, OTHER = Caller("host 127.0.0.1"), Caller("host 127.0.0.2")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(
    max_streams: int = 3, max_seq_len: int = 64, max_bytes: int = 1 << 20, idle: float = 60.0
) -> tuple[StreamTable[KVCache], Clock, list[tuple[str, str]]]:
    clock, freed = Clock(), []
    t = StreamTable(
        Limits(max_streams, max_seq_len, max_bytes, idle),
        lambda: KVCache(1, 1),
        BPT,
        clock=clock,
        on_free=lambda s, why: freed.append((s.id, why)),
    )
    return t, clock, freed


def step(
    t: StreamTable[KVCache], sid: str, start: int, n: int = 1, caller: Caller = ME, ok: bool = True, **kw: bool
) -> Stream[KVCache]:
    """claim, begin, 'compute' (append n tokens), done: what the service does around the block call."""
    stream = t.claim(sid, caller, start)
    try:
        t.begin(stream, start, n)
    except StreamError:
        t.done(stream, ok=False, began=False)
        raise
    stream.cache.append(torch.zeros(1, n, 1), torch.zeros(1, n, 1))
    t.done(stream, ok=ok, began=True, **kw)
    return stream


def refused(code: str, fn, *args, **kw) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(StreamError) as exc:
        fn(*args, **kw)
    assert exc.value.code == code, (exc.value.code, str(exc.value))
    return str(exc.value)


def test_the_least_recently_used_idle_stream_makes_room_and_a_late_step_hears_why() -> None:
    t, clock, freed = table(max_streams=3)
    for sid in ("a", "b", "c"):
        step(t, sid, 0, 4)
        clock.now += 1
    step(t, "a", 4)  # a is now the most recent: b is the oldest idle stream
    step(t, "d", 0, 2)
    assert freed == [("b", SLOTS)] and {"a", "c", "d"} == {s for s in "abcd" if s in t}
    message = refused(NOT_FOUND, t.claim, "b", ME, 4)
    assert "stream b evicted (least recently used" in message and "3 stream slots" in message
    # the owner reopens it from start 0 (a rebuild); another caller learns nothing of the old one
    assert "stream b unknown" in refused(NOT_FOUND, t.claim, "b", OTHER, 4)
    step(t, "b", 0, 3)
    assert freed[-1] == ("c", SLOTS)  # c was the oldest idle one then


def test_a_stream_in_a_step_is_never_evicted_and_a_full_house_refuses_without_harm() -> None:
    t, _, freed = table(max_streams=2)
    busy = [t.claim(sid, ME, 0) for sid in ("a", "b")]  # both in the middle of a step
    message = refused(RESOURCE_EXHAUSTED, t.claim, "c", ME, 0)
    assert "all 2 stream slots are in a step" in message
    assert freed == [] and "c" not in t and len(t) == 2
    for stream in busy:
        t.begin(stream, 0, 1)
        stream.cache.append(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
        t.done(stream, ok=True, began=True)
    step(t, "c", 0)
    assert freed == [("a", SLOTS)]


def test_bytes_evict_the_oldest_idle_streams_and_a_hopeless_growth_disturbs_nobody() -> None:
    t, clock, freed = table(max_streams=10, max_seq_len=256, max_bytes=4 * FIRST)
    for sid in "abcd":
        step(t, sid, 0, 10)  # each books 16 tokens of capacity
        clock.now += 1
    assert t.booked_bytes == 4 * FIRST
    step(t, "a", 10, 10)  # a grows to 32 tokens of capacity: the oldest idle (b) goes
    assert freed == [("b", BYTES)] and t.booked_bytes == 4 * FIRST
    assert "least recently used: the node's" in refused(NOT_FOUND, t.claim, "b", ME, 10)
    # 200 tokens need 256 of capacity (2048 bytes) and the whole cache is 512: refused, nobody evicted
    message = refused(RESOURCE_EXHAUSTED, step, t, "c", 10, 190)
    assert "needs" in message and freed == [("b", BYTES)] and t.allocated_bytes() == t.booked_bytes
    assert t.held("c") == 10  # c is unchanged by its refused step


def test_rollback_truncates_a_longer_start_is_refused_and_a_failed_step_changes_nothing() -> None:
    t, _, _ = table()
    stream = step(t, "a", 0, 8)
    step(t, "a", 8, 5)  # five drafts
    step(t, "a", 10, 3)  # two accepted: verify from 10
    assert stream.cache.length == 13
    assert "holds 13 tokens here, the step starts at 20" in refused(FAILED_PRECONDITION, step, t, "a", 20)
    assert "context is 64" in refused(RESOURCE_EXHAUSTED, step, t, "a", 13, 52)
    assert stream.cache.length == 13
    step(t, "a", 11, 2, ok=False)  # a compute that failed after it appended: rolled back to its start
    assert stream.cache.length == 11
    step(t, "new", 0, 4, ok=False)  # a failed first step: as if it was never sent
    assert "new" not in t and "unknown" in refused(NOT_FOUND, t.claim, "new", ME, 4)


def test_another_caller_cannot_step_or_release_and_changes_nothing() -> None:
    t, _, freed = table()
    stream = step(t, "a", 0, 4)
    assert "belongs to another caller" in refused(PERMISSION_DENIED, t.claim, "a", OTHER, 4)
    assert "belongs to another caller" in refused(PERMISSION_DENIED, t.claim, "a", OTHER, 0)
    step(t, "mine", 0, 1, caller=OTHER)
    refused(PERMISSION_DENIED, t.release, ["mine", "a"], OTHER)  # one foreign id: nothing is released
    assert "a" in t and "mine" in t and freed == [] and stream.pending == 0 and stream.cache.length == 4
    assert t.release(["mine", "never-seen"], OTHER) == 1 and freed == [("mine", RELEASED)]
    assert "released" in refused(NOT_FOUND, t.claim, "mine", OTHER, 1)


def test_a_stream_opened_over_a_decodestream_is_stepped_only_over_it_and_freed_when_it_ends() -> None:
    t, _, freed = table()
    over_one, over_two = Caller(ME.principal, 1), Caller(ME.principal, 2)
    step(t, "a", 0, 2, caller=over_one)
    step(t, "b", 0, 2, caller=ME)  # a unary Decode: bound to the principal only
    assert "opened over another DecodeStream" in refused(PERMISSION_DENIED, t.claim, "a", over_two, 2)
    assert "opened over another DecodeStream" in refused(PERMISSION_DENIED, t.claim, "a", ME, 2)
    step(t, "b", 2, 1, caller=over_two)
    held = t.claim("a", over_one, 2)  # a step in flight when the stream ends
    assert t.close_connection(1) == 1 and "a" in t  # ... keeps it until the step is done
    assert "ended" in refused(NOT_FOUND, t.begin, held, 2, 1)
    t.done(held, ok=False, began=False)
    assert "a" not in t and freed == [("a", STREAM_ENDED)] and t.close_connection(2) == 0
    assert t.release(["b"], Caller(ME.principal, 7)) == 1  # a release needs the principal only


def test_the_idle_timeout_frees_streams_no_step_touched() -> None:
    t, clock, freed = table(idle=10.0)
    step(t, "old", 0, 3)
    clock.now += 6
    step(t, "young", 0, 3)
    busy = t.claim("busy", ME, 0)
    clock.now += 5
    assert t.expire() == 1 and freed == [("old", IDLE)]
    assert "evicted (idle for more than 10 s)" in refused(NOT_FOUND, t.claim, "old", ME, 3)
    clock.now += 20
    assert t.expire() == 1 and "busy" in t  # the one in a step stays
    t.done(busy, ok=False, began=False)
    assert len(t) == 0 and t.booked_bytes == 0


def test_the_release_flag_frees_after_the_step() -> None:
    t, _, freed = table()
    step(t, "a", 0, 3)
    step(t, "a", 3, 1, release=True)
    assert "a" not in t and freed == [("a", RELEASED)] and t.booked_bytes == 0


def test_random_traffic_keeps_every_bound_and_the_books_balanced() -> None:
    """Thousands of random steps, verifies, releases, expiries and connection ends by two callers: the
    table never holds more streams than its slots or books more bytes than its limit, its books equal
    what the caches hold, and once everything is freed nothing is left."""
    rng = random.Random(7)
    t, clock, _ = table(max_streams=6, max_seq_len=100, max_bytes=12 * FIRST, idle=30.0)
    callers = [Caller("host a", 1), Caller("host a"), Caller("host b", 2)]
    for _ in range(4000):
        clock.now += rng.random()
        sid, caller = f"s{rng.randrange(12)}", rng.choice(callers)
        action = rng.random()
        try:
            if action < 0.75:
                held = t.held(sid)
                start = rng.choice((held, held, rng.randrange(held + 1), held + 3, 0))  # on, back, ahead, anew
                n = rng.choice((1, 1, 1, 4, 20, 40))
                release = rng.random() < 0.05
                stream = step(t, sid, start, n, caller=caller, release=release)
                assert stream.cache.length == start + n and (sid in t) != release
            elif action < 0.85:
                t.release([sid], caller)
            elif action < 0.95:
                t.expire()
            else:
                t.close_connection(rng.choice((1, 2)))
        except StreamError as exc:
            assert exc.code in (NOT_FOUND, FAILED_PRECONDITION, PERMISSION_DENIED, RESOURCE_EXHAUSTED)
        assert len(t) <= 6 and t.booked_bytes <= 12 * FIRST
        assert t.booked_bytes == t.allocated_bytes()
        assert all(s.pending == 0 for s in t.streams())
    clock.now += 100
    t.expire()
    assert len(t) == 0 and t.booked_bytes == 0


class FakeContext:
    def __init__(self, peer: str, pem: bytes | None = None) -> None:
        self._peer, self._pem = peer, pem

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_pem_cert": [self._pem]} if self._pem else {}


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.0.0.7:5123", "10.0.0.7"),
        ("ipv6:[::1]:5123", "::1"),
        ("ipv6:%5B::ffff:127.0.0.1%5D:80", "::ffff:127.0.0.1"),
        ("unix:/run/x.sock", "unix:/run/x.sock"),
    ],
)
def test_the_callers_host_is_the_address_without_its_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host


def test_a_caller_is_its_host_and_under_tls_its_certificate_too() -> None:
    plain = caller_of(FakeContext("ipv4:10.0.0.7:5123"))
    other_port = caller_of(FakeContext("ipv4:10.0.0.7:6000"), connection=3)
    assert plain.principal == other_port.principal == "host 10.0.0.7" and other_port.connection == 3
    one = caller_of(FakeContext("ipv4:10.0.0.7:5123", b"-----BEGIN CERTIFICATE-----one"))
    two = caller_of(FakeContext("ipv4:10.0.0.7:5123", b"-----BEGIN CERTIFICATE-----two"))
    elsewhere = caller_of(FakeContext("ipv4:10.0.0.8:5123", b"-----BEGIN CERTIFICATE-----one"))
    assert len({plain.principal, one.principal, two.principal, elsewhere.principal}) == 4
    assert one.principal.startswith("host 10.0.0.7 cert ")
