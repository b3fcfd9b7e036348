"""Which generation streams a decoder node holds, for whom, and what it frees first: pure logic.

A stream is one caller's sequence at this node's block: its KV cache between one token and the next
(docs/generation.md). The table bounds them three ways (streams, tokens per stream, bytes of all caches
together) and frees them:

    claim(id, caller, start)   the stream a step names, checked against its caller; start 0 opens an
                               unknown id (taking a slot: the least recently used idle stream goes when
                               every slot is taken). Counts the step as pending: never evicted until done.
    begin(stream, start, n)    under the stream's own lock (the service's): roll back to `start`, check
                               the context, book the bytes the step will allocate (evicting idle streams)
    done(stream, ok, began)    the step ended: a failed one is rolled back, so a refusal changes nothing
    release / expire / close_connection
                               freed by the caller, by the idle timeout, when its DecodeStream ended

Ownership: a stream belongs to the caller that opened it (Caller.principal: its host, and its TLS
certificate when it has one; node/callers.py), and a stream opened over a DecodeStream to that stream
(Caller.connection). Anyone else is refused and changes nothing.

No sockets, no event loop, no torch: the service does the I/O, the batcher the compute, and the table
only decides. Errors carry a gRPC status name (StreamError.code) that the service answers with.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

# What a failed step names, as gRPC status names (the service maps them; this module imports no grpc).
NOT_FOUND = "NOT_FOUND"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
PERMISSION_DENIED = "PERMISSION_DENIED"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"

# Why a stream was freed: the metric label, and the words a later step of it reads in NOT_FOUND.
SLOTS = "slots"
BYTES = "bytes"
IDLE = "idle"
STREAM_ENDED = "stream_ended"
RELEASED = "released"
EVICTION_REASONS = (SLOTS, BYTES, IDLE, STREAM_ENDED)  # all but the caller's own release

REMEMBERED = 4096  # freed stream ids kept (with why), so a late step hears "evicted", not "unknown"


class StreamError(Exception):
    """A step or release the table refuses: `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Cache(Protocol):
    """What the table needs of a KV cache (models/lm/cache.py: KVCache)."""

    @property
    def length(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def capacity_after(self, length: int) -> int: ...
    def truncate(self, n: int) -> None: ...


CacheT = TypeVar("CacheT", bound=Cache)


@dataclass(frozen=True)
class Limits:
    max_streams: int
    max_seq_len: int  # tokens per stream: the model's context
    max_cache_bytes: int  # every stream's keys and values together, as allocated
    idle_timeout_s: float


@dataclass(frozen=True)
class Caller:
    """Who sent a step: `principal` (host, and certificate under mutual TLS) and, over a DecodeStream,
    which one (a number per call)."""

    principal: str
    connection: int | None = None


@dataclass(eq=False)
class Stream(Generic[CacheT]):
    id: str
    owner: Caller
    cache: CacheT
    last_used: float
    pending: int = 0  # steps holding or waiting for it: never evicted while any is
    booked: int = 0  # bytes counted against the limit: its cache's, or what its running step may grow it to
    step_start: int = 0  # where the running step began (a failure rolls back to it)
    freed: str | None = None  # why it was freed while a step still held it (dropped when the step ends)
    fresh: bool = True  # no step has succeeded yet: a failed first step removes it
    # The service's lock (steps of one stream run one at a time, in arrival order); opaque here.
    serial: Any = None


@dataclass
class TableStats:
    streams: int
    tokens: int
    booked_bytes: int


class StreamTable(Generic[CacheT]):
    def __init__(
        self,
        limits: Limits,
        new_cache: Callable[[], CacheT],
        bytes_per_token: int,
        clock: Callable[[], float] = time.monotonic,
        on_free: Callable[[Stream[CacheT], str], None] | None = None,
    ) -> None:
        self.limits = limits
        self.new_cache = new_cache
        self.bytes_per_token = bytes_per_token  # keys and values of one token of capacity
        self.clock = clock
        self.on_free = on_free or (lambda stream, reason: None)
        self._streams: OrderedDict[str, Stream[CacheT]] = OrderedDict()  # least recently used first
        self._freed: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (owner's principal, why)
        self.booked_bytes = 0

    # -- a step: claim, begin (under the stream's lock), done --------------------------------------

    def claim(self, stream_id: str, caller: Caller, start: int) -> Stream[CacheT]:
        """The stream `stream_id` for one more step by `caller`, who must own it; start 0 opens an
        unknown id. Every claim must be followed by `done`, whatever happens in between."""
        stream = self._streams.get(stream_id)
        if stream is None:
            if start != 0:
                raise StreamError(NOT_FOUND, self._missing(stream_id, caller))
            self._make_room_for_a_stream(stream_id)
            stream = Stream(stream_id, caller, self.new_cache(), self.clock())
            self._streams[stream_id] = stream
            self._freed.pop(stream_id, None)
        else:
            self._check_owner(stream, caller, stepping=True)
            if stream.freed is not None:
                raise StreamError(NOT_FOUND, _freed_message(stream_id, stream.freed, self.limits))
            self._streams.move_to_end(stream_id)
        stream.pending += 1
        stream.last_used = self.clock()
        return stream

    def begin(self, stream: Stream[CacheT], start: int, tokens: int) -> None:
        """Before the compute: the stream rolled back to `start` tokens and room booked for `tokens`
        more. Checks everything first, so a refusal leaves the stream (and every other) as it was."""
        if stream.freed is not None:
            raise StreamError(NOT_FOUND, _freed_message(stream.id, stream.freed, self.limits))
        held = stream.cache.length
        if start > held:
            raise StreamError(
                FAILED_PRECONDITION,
                f"stream {stream.id} holds {held} tokens here, the step starts at {start}: rebuild it from start 0",
            )
        end = start + tokens
        if end > self.limits.max_seq_len:
            raise StreamError(
                RESOURCE_EXHAUSTED,
                f"stream {stream.id} would hold {end} tokens; the context is {self.limits.max_seq_len}",
            )
        need = stream.cache.capacity_after(end) * self.bytes_per_token
        if need > stream.booked:
            self._make_room_for_bytes(need - stream.booked, stream)
            self._book(stream, need)
        if start < held:
            stream.cache.truncate(start)  # speculative decoding: the rejected drafts go
        stream.step_start = start

    def done(self, stream: Stream[CacheT], ok: bool, began: bool, release: bool = False) -> None:
        """The step ended (ok: its tokens are in the cache; began: `begin` accepted it). A failed step that
        began is rolled back to its start; a failed first step of a new stream removes it, as if it had
        never been sent. Call it under the stream's lock, like `begin`: the rollback point is this step's."""
        stream.pending -= 1
        if began and not ok and stream.cache.length > stream.step_start:
            stream.cache.truncate(stream.step_start)
        stream.last_used = self.clock()
        if ok:
            stream.fresh = False
        elif stream.fresh and stream.pending == 0 and stream.freed is None:
            self._forget(stream)
            return
        if release and stream.freed is None:
            stream.freed = RELEASED
        if stream.freed is not None:
            if stream.pending == 0:
                self._drop(stream, stream.freed)
            return
        self._book(stream, stream.cache.nbytes)  # what it holds now (at most what was booked)

    # -- freeing -----------------------------------------------------------------------------------

    def release(self, stream_ids: Iterable[str], caller: Caller) -> int:
        """Free the caller's streams among `stream_ids` (unknown ids are ignored); any id another caller
        holds refuses the whole call, which then frees nothing. Returns how many were freed."""
        held = [s for s in (self._streams.get(i) for i in dict.fromkeys(stream_ids)) if s is not None]
        for stream in held:
            self._check_owner(stream, caller, stepping=False)
        live = [s for s in held if s.freed is None]
        for stream in live:
            self._free(stream, RELEASED)
        return len(live)

    def expire(self) -> int:
        """Free every stream no step has touched for idle_timeout_s; returns how many."""
        cutoff = self.clock() - self.limits.idle_timeout_s
        idle = [s for s in self._streams.values() if s.pending == 0 and s.last_used <= cutoff]
        for stream in idle:
            self._free(stream, IDLE)
        return len(idle)

    def close_connection(self, connection: int) -> int:
        """The DecodeStream `connection` ended: free the streams opened over it; returns how many."""
        bound = [s for s in self._streams.values() if s.owner.connection == connection and s.freed is None]
        for stream in bound:
            self._free(stream, STREAM_ENDED)
        return len(bound)

    def clear(self) -> None:
        for stream in list(self._streams.values()):
            self._free(stream, STREAM_ENDED)

    # -- reading -----------------------------------------------------------------------------------

    def stats(self) -> TableStats:
        tokens = sum(s.cache.length for s in self._streams.values())
        return TableStats(len(self._streams), tokens, self.booked_bytes)

    def held(self, stream_id: str) -> int:
        """Tokens the stream holds here (0: none, or no such stream)."""
        stream = self._streams.get(stream_id)
        return stream.cache.length if stream is not None else 0

    def streams(self) -> list[Stream[CacheT]]:
        """Every stream held, least recently used first."""
        return list(self._streams.values())

    def allocated_bytes(self) -> int:
        """What the caches really hold (booked_bytes equals it between steps)."""
        return sum(s.cache.nbytes for s in self._streams.values())

    def __contains__(self, stream_id: str) -> bool:
        return stream_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    # -- inside ------------------------------------------------------------------------------------

    def _check_owner(self, stream: Stream[CacheT], caller: Caller, stepping: bool) -> None:
        """Steps come from the opener (over its DecodeStream, when it opened the stream over one); a
        release from the same principal over any call."""
        owner = stream.owner
        same = owner.principal == caller.principal
        if stepping and owner.connection is not None:
            same = same and owner.connection == caller.connection
        if not same:
            over = " (it was opened over another DecodeStream)" if owner.principal == caller.principal else ""
            raise StreamError(PERMISSION_DENIED, f"stream {stream.id} belongs to another caller{over}")

    def _missing(self, stream_id: str, caller: Caller) -> str:
        freed = self._freed.get(stream_id)
        if freed is not None and freed[0] == caller.principal:  # others learn nothing of it
            return _freed_message(stream_id, freed[1], self.limits)
        return f"stream {stream_id} unknown: open it with start 0"

    def _idle_oldest_first(self, keep: Stream[CacheT] | None = None) -> list[Stream[CacheT]]:
        return [s for s in self._streams.values() if s.pending == 0 and s.freed is None and s is not keep]

    def _make_room_for_a_stream(self, stream_id: str) -> None:
        if len(self._streams) < self.limits.max_streams:
            return
        idle = self._idle_oldest_first()
        if not idle:
            raise StreamError(
                RESOURCE_EXHAUSTED,
                f"cannot open stream {stream_id}: all {self.limits.max_streams} stream slots are in a step",
            )
        self._free(idle[0], SLOTS)

    def _make_room_for_bytes(self, grow: int, stream: Stream[CacheT]) -> None:
        limit = self.limits.max_cache_bytes
        if self.booked_bytes + grow <= limit:
            return
        idle = self._idle_oldest_first(keep=stream)
        can_free = sum(s.booked for s in idle)
        if self.booked_bytes + grow - can_free > limit:  # evicting would not be enough: disturb nobody
            raise StreamError(
                RESOURCE_EXHAUSTED,
                f"stream {stream.id} needs {grow} more bytes of cache; {self.booked_bytes - can_free} of the "
                f"node's {limit} are held by streams in a step",
            )
        for victim in idle:
            if self.booked_bytes + grow <= limit:
                break
            self._free(victim, BYTES)

    def _free(self, stream: Stream[CacheT], reason: str) -> None:
        """Free now, or (a step holds it) refuse its next steps and drop it when the step ends."""
        stream.freed = reason
        if stream.pending == 0:
            self._drop(stream, reason)

    def _drop(self, stream: Stream[CacheT], reason: str) -> None:
        if self._streams.get(stream.id) is not stream:
            return
        self._forget(stream)
        self._freed[stream.id] = (stream.owner.principal, reason)
        while len(self._freed) > REMEMBERED:
            self._freed.popitem(last=False)
        self.on_free(stream, reason)

    def _forget(self, stream: Stream[CacheT]) -> None:
        del self._streams[stream.id]
        self._book(stream, 0)

    def _book(self, stream: Stream[CacheT], nbytes: int) -> None:
        self.booked_bytes += nbytes - stream.booked
        stream.booked = nbytes


def _freed_message(stream_id: str, reason: str, limits: Limits) -> str:
    why = {
        SLOTS: f"least recently used: every one of the node's {limits.max_streams} stream slots was wanted",
        BYTES: f"least recently used: the node's {limits.max_cache_bytes}-byte cache was full",
        IDLE: f"idle for more than {limits.idle_timeout_s:g} s",
        STREAM_ENDED: "the DecodeStream it was opened over ended",
    }
    if reason == RELEASED:
        return f"stream {stream_id} released: open it again with start 0"
    return f"stream {stream_id} evicted ({why.get(reason, reason)}): rebuild it with start 0"
