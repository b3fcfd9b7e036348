"""What a stranger can cost a node: refusals decided from metadata, calls at once per peer and in all.

Every call, whatever its method (methods added later included), passes one interceptor, which decides
from the call's metadata alone, before its message is read:

- A BlockNode method without valid swarm credentials is refused at once (UNAUTHENTICATED), its message
  never read: a tokenless peer's max-size message is not buffered (before, a refused call's message was
  read whole; 16 connections of them held 1.8 GiB). A caller whose MAC is right but stale (a coordinator
  that has not yet seen our restart) gets the polite refusal that lets its first message in first, so
  that it reads our status and new challenge rather than grpc.aio's INTERNAL (wire/security.py).
- Every handler is run request-streaming (a unary one reads its one message itself), so the limits
  below are taken before any message is read: calls at once per peer address (swarm members, and
  calls without credentials: health and Info, which stay open for probes and the handshake, with a small
  budget of their own, per address and in all) answered RESOURCE_EXHAUSTED past them; the server's own
  `maximum_concurrent_rpcs` caps every call, and HTTP/2's `max_concurrent_streams` each connection.

With a swarm token, a call to an open method that carries valid credentials (the coordinator signs its
health checks once the node has proved itself) counts as a member's, so a stranger flooding health
checks from the coordinator's own address cannot starve them. Without a token everyone is a member.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import time
import traceback
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from layerswarm.wire.auth import AUTH_KEY, NONCE_KEY, AuthError, NodeAuthenticator, metadata_value
from layerswarm.wire.discovery import METHOD_PREFIX
from layerswarm.wire.memory import give_back_free_memory
from layerswarm.wire.security import deny, with_proof

log = logging.getLogger(__name__)

INFO = METHOD_PREFIX + "Info"
MAX_BUCKETS = 4096  # addresses whose rate of calls without credentials is remembered


@dataclass(frozen=True)
class CallLimits:
    """Calls at once (streams included) a node accepts (NodeSettings: max_calls...)."""

    total: int = 1024  # every call (grpc's maximum_concurrent_rpcs)
    per_peer: int = 256  # from one address, with credentials (also HTTP/2 streams per connection)
    strangers: int = 16  # without credentials (health, Info), from all addresses
    stranger_per_peer: int = 4  # ... from one address
    stranger_rate: float = 10.0  # calls a second without credentials from one address (bursts of twice that)
    connections: int = 256  # TCP connections at once (grpc's max_allowed_incoming_connections)


class Slots:
    """Calls in flight per peer address and class; `take` refuses past the limits."""

    def __init__(self, limits: CallLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.members: Counter[str] = Counter()
        self.strangers: Counter[str] = Counter()
        self.stranger_total = 0
        self.refused = 0  # ever: calls refused (grpc.aio keeps each aborted call's exception in a cycle)
        self.stranger_calls = 0  # ever: calls without credentials, refused or served (memory.py trims after)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, when)

    def _within_rate(self, peer: str) -> bool:
        """A token bucket per address for calls without credentials: health probes and the Info handshake
        come a few times a minute, a flood of padded ones hundreds of times a second (each read whole)."""
        now, rate = self.clock(), self.limits.stranger_rate
        tokens, when = self._buckets.pop(peer, (2 * rate, now))
        tokens = min(2 * rate, tokens + (now - when) * rate)
        self._buckets[peer] = (tokens - 1, now) if tokens >= 1 else (tokens, now)
        while len(self._buckets) > MAX_BUCKETS:  # bounded: the longest quiet addresses go first
            self._buckets.popitem(last=False)
        return tokens >= 1

    @contextlib.contextmanager
    def take(self, peer: str, stranger: bool) -> Iterator[bool]:
        """Yields whether the call may go on; a taken slot is given back when it ends."""
        limits = self.limits
        if stranger:
            self.stranger_calls += 1
            ok = (
                self.strangers[peer] < limits.stranger_per_peer
                and self.stranger_total < limits.strangers
                and self._within_rate(peer)
            )
        else:
            ok = self.members[peer] < limits.per_peer
        if not ok:
            self.refused += 1
            yield False
            return
        counts = self.strangers if stranger else self.members
        counts[peer] += 1
        self.stranger_total += stranger
        try:
            yield True
        finally:
            counts[peer] -= 1
            if counts[peer] <= 0:
                del counts[peer]
            self.stranger_total -= stranger


def peer_address(context: grpc.aio.ServicerContext) -> str:
    """The caller's address without its port ("ipv4:10.0.0.7:53124" -> "ipv4:10.0.0.7")."""
    peer = context.peer() or "?"
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


class CallGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    """The node's one interceptor for credentials and call limits (the module docstring)."""

    def __init__(self, auth: NodeAuthenticator | None, limits: CallLimits) -> None:
        self.auth = auth
        self.slots = Slots(limits)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata
        stranger = False
        if self.auth is not None:
            header = metadata_value(metadata, AUTH_KEY)
            try:
                self.auth.verify(method, header)
            except AuthError as exc:
                if method.startswith(METHOD_PREFIX) and method != INFO:
                    self.slots.stranger_calls += 1
                    self.slots.refused += 1
                    log.info("refused %s: %s", method, exc)
                    # Only a holder of the token (a stale challenge, clock or nonce) is let in to its first
                    # message: anyone else is refused before a byte of theirs is read.
                    polite = header is not None and self.auth.signed_by_us(method, header)
                    return deny(method, str(exc), self.auth.challenge_metadata(), read_first=polite)
                stranger = True  # an open method without credentials: health, or the Info handshake
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if method == INFO and self.auth is not None:
            handler = with_proof(handler, self.auth, metadata_value(metadata, NONCE_KEY))
        return limited(handler, self.slots, stranger)


class MemoryKeeper:
    """Gives freed memory back to the kernel after strangers' calls (wire/memory.py): every `interval_s`
    in which any came, so a flood leaves the node its size from before (measured: bench/grpc_flood.py)."""

    def __init__(self, slots: Slots, interval_s: float = 1.0) -> None:
        self.slots = slots
        self.interval_s = interval_s
        self.trims = 0
        self._seen = 0
        self._refused_seen = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="memory-keeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        busy = False
        while True:
            await asyncio.sleep(self.interval_s)
            calls, refused = self.slots.stranger_calls, self.slots.refused
            if calls == self._seen and not busy:
                continue
            # The strangers have stopped: what their refused calls left in cycles (grpc.aio keeps each
            # aborted call's exception in one) goes, then its pages. Only after refusals: a full
            # collection stalls the event loop (100 ms and more in a loaded process), and the calls a
            # node serves every minute without credentials (health probes, the Info handshake) leave
            # no cycles.
            if calls == self._seen and refused != self._refused_seen:
                gc.collect()
                self._refused_seen = refused
            busy, self._seen = calls != self._seen, calls
            try:  # off the loop: trimming walks every arena
                await asyncio.get_running_loop().run_in_executor(None, give_back_free_memory)
                self.trims += 1
            except OSError:
                log.exception("malloc_trim failed; going on")


def limited(handler: Any, slots: Slots, stranger: bool) -> Any:
    """`handler` as a request-streaming handler that takes a slot before it reads any message."""
    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

    def admitted(context: grpc.aio.ServicerContext) -> contextlib.AbstractContextManager[bool]:
        return slots.take(peer_address(context), stranger)

    async def refuse(context: grpc.aio.ServicerContext) -> None:
        who = "calls without credentials" if stranger else "calls"
        log.info("refused a call from %s: too many %s at once", context.peer(), who)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many {who} at once from {context.peer()}")

    if not handler.response_streaming:
        inner_unary = handler.unary_unary or handler.stream_unary
        one = handler.unary_unary is not None

        async def unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            with admitted(context) as ok:
                if not ok:
                    await refuse(context)
                request = (await _first(requests, context)) if one else requests
                try:
                    return await _awaited(inner_unary(request, context))
                except BaseException as exc:
                    del request  # this frame's reference: the exception's cycle keeps the frame
                    _forget_locals(exc)
                    raise

        return grpc.stream_unary_rpc_method_handler(unary, **codec)

    inner_stream = handler.unary_stream or handler.stream_stream
    one = handler.unary_stream is not None
    if inspect.isasyncgenfunction(inner_stream):

        async def replies(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with admitted(context) as ok:
                if not ok:
                    await refuse(context)
                request = (await _first(requests, context)) if one else requests
                async for reply in inner_stream(request, context):
                    yield reply

        return grpc.stream_stream_rpc_method_handler(replies, **codec)

    async def writes(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        """A streaming handler that answers with context.write (grpc.health's Watch), or a sync one."""
        with admitted(context) as ok:
            if not ok:
                await refuse(context)
            request = (await _first(requests, context)) if one else requests
            result = await _awaited(inner_stream(request, context))
            for reply in result or ():  # a sync generator's replies
                await context.write(reply)

    return grpc.stream_stream_rpc_method_handler(writes, **codec)


async def _first(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
    """A unary method's one request (read here, after the slot was taken). The receiving generator is
    closed at once: left suspended, it would hold the message until the cyclic garbage collector ran
    (measured: a flood of 1.3 MB health checks grew a node by 600 MB that malloc_trim could not return)."""
    receiver = aiter(requests)
    try:
        return await anext(receiver)
    except StopAsyncIteration:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
    finally:
        await close_receiver(receiver)


async def close_receiver(receiver: Any) -> None:
    """Finish the async generator grpc.aio's request iterator handed out (aiter(requests))."""
    aclose = getattr(receiver, "aclose", None)
    if aclose is not None:
        await aclose()


def _forget_locals(exc: BaseException) -> None:
    """Clear the finished frames of `exc`'s traceback (their locals hold the request): an aborted call's
    exception sits in a reference cycle inside grpc.aio, and until the cyclic collector ran, each held
    its whole message (a health check padded to 1.3 MB, refused NOT_FOUND: +400 MiB under a flood)."""
    traceback.clear_frames(exc.__traceback__)


async def _awaited(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
