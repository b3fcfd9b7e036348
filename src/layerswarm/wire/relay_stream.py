"""Relay chains over one long-lived stream per caller and next node (RelayStream), both ends.

A Relay call per chain costs a new HTTP/2 stream, its signed metadata and its checks at both ends:
about half a millisecond a hop on loopback (the bench's unary vs stream echo). Between two nodes that
pass many chains to each other (and from the coordinator to the nodes that start its chains), one
stream carries them all: the requests of many chains go in, their
events come back matched by request_id, each request's events exactly as a Relay call's (an
acknowledgement, then the final one). The stream is authenticated once, when it opens, like any call
(signed with the swarm key, or the relay certificate under TLS); every chain on it is still checked
against the coordinator's MAC (node/relay.py). A refusal is an event (`refused`) and the stream stays.

Client: `RelayLink` (one per peer, opened on first use, reopened after it breaks; a break fails every
request waiting on it, which the sender hands back as it would a dead next node). Server:
`serve_relay_stream` runs each request as its own task, bounded in number and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from layerswarm.wire.v1 import block_pb2 as pb

log = logging.getLogger(__name__)
MAX_STREAM_IN_FLIGHT = 256  # chains one stream may have in flight at a node; past it: refused
STATUS_WAIT_S = 1.0  # a refused stream's status follows its (empty) headers at once
# Sent by a node as soon as it takes a stream: the sender's first write waits for it, so a stream refused
# at open (unauthenticated, a certificate without the role) reports that status, not a failed write.
ACCEPTED = ("layerswarm-relay-stream", "accepted")
LATE_GRACE_S = 1.0  # a request's task may outlive its deadline by this much (its final event)
Events = Callable[[pb.RelayRequest], AsyncIterator[pb.RelayEvent]]
Inbox = asyncio.Queue[pb.RelayEvent | grpc.aio.AioRpcError]  # one request's events, or what broke the stream


def unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def refusal_error(event: pb.RelayEvent) -> grpc.aio.AioRpcError:
    """A refusal event as the status a Relay call would have ended with."""
    code = getattr(grpc.StatusCode, event.refused, grpc.StatusCode.UNKNOWN)
    if not isinstance(code, grpc.StatusCode):  # a peer's odd name never picks an attribute that is not a code
        code = grpc.StatusCode.UNKNOWN
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=event.handback_reason)


class _Waiter:
    """What one request may still receive: at most one acknowledgement, then one final event (or a
    refusal); anything more from the peer is dropped, so a peer cannot grow our memory."""

    def __init__(self) -> None:
        self.queue: Inbox = asyncio.Queue()
        self.acked = False

    def take(self, event: pb.RelayEvent) -> bool:
        """Queue `event` if the protocol allows it here; True when it ends the request."""
        if event.ack and not event.refused:
            if not self.acked:
                self.acked = True
                self.queue.put_nowait(event)
            return False
        self.queue.put_nowait(event)
        return True


class LinkedCall:
    """One request's events on a RelayLink, read like a Relay call's: read() an event or raise."""

    def __init__(self, stream: _Stream, request_id: str, waiter: _Waiter) -> None:
        self._stream, self._id, self._queue = stream, request_id, waiter.queue

    async def read(self) -> pb.RelayEvent:
        item = await self._queue.get()
        if isinstance(item, grpc.aio.AioRpcError):
            self._queue.put_nowait(item)  # the stream stays broken for any later read too
            raise item
        if item.refused:
            raise refusal_error(item)
        return item

    def cancel(self) -> None:
        """Stop listening (the next node's task ends by its own deadline). Idempotent."""
        self._stream.waiting.pop(self._id, None)


class _Stream:
    """One open RelayStream call and the requests waiting on it."""

    def __init__(self, call: Any, peer: str) -> None:
        self.call = call
        self.waiting: dict[str, _Waiter] = {}
        self.write_lock = asyncio.Lock()  # grpc.aio allows one write at a time on a stream
        self.broken: grpc.aio.AioRpcError | None = None
        self.reader = asyncio.create_task(self._read(), name=f"relay stream to {peer}")
        self.reader.add_done_callback(_log_crash)

    async def _read(self) -> None:
        error = unavailable("the next node closed the relay stream")
        try:
            async for event in self.call:
                waiter = self.waiting.get(event.request_id)
                # None: a request given up on, or one already ended: its late events are dropped.
                if waiter is not None and waiter.take(event):
                    del self.waiting[event.request_id]
        except grpc.aio.AioRpcError as exc:
            error = exc
        finally:
            self.broken = self.broken or error  # `_status` may have given up on this stream first
            for waiter in self.waiting.values():
                waiter.queue.put_nowait(self.broken)
            self.waiting.clear()

    async def accepted(self) -> None:
        """Wait for the node's headers; raise the stream's status if it was refused at open."""
        headers = await self.call.initial_metadata()
        if ACCEPTED not in tuple(headers or ()):
            await self._status(unavailable("relay stream refused without a status"))

    async def _status(self, fallback: grpc.aio.AioRpcError) -> None:
        """Raise the status the stream ended with; without one in time, give the stream up (the next
        request opens a new one rather than writing on a stream that was never accepted)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.reader), STATUS_WAIT_S)
        if self.broken is None:
            self.broken = fallback
            self.call.cancel()
        raise self.broken

    async def send(self, request: pb.RelayRequest) -> LinkedCall:
        rid = request.forward.request_id
        if self.broken is not None:
            raise self.broken
        if rid in self.waiting:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.ALREADY_EXISTS, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"{rid} in flight"
            )
        waiter = self.waiting[rid] = _Waiter()
        linked = LinkedCall(self, rid, waiter)
        try:
            async with self.write_lock:
                await self.call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # The stream ended as we wrote (the peer went away): its status, which the reader is about
            # to see, says why; the write's own error only says it failed.
            linked.cancel()
            await self._status(unavailable(f"relay stream closed: {exc}"))
        return linked

    async def close(self) -> None:
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s crashed", task.get_name(), exc_info=task.exception())


class RelayLink:
    """The long-lived RelayStream to one peer; `open_call()` makes a new signed stream call."""

    def __init__(self, peer: str, open_call: Callable[[], Any]) -> None:
        self.peer = peer
        self._open_call = open_call
        self._stream: _Stream | None = None
        self.opened = 0  # streams opened so far (one, unless they broke)

    async def send(self, request: pb.RelayRequest) -> LinkedCall:
        """Put one chain's request on the stream (opening one if there is none or it broke)."""
        if self._stream is None or self._stream.broken is not None:
            self._stream = _Stream(self._open_call(), self.peer)
            self.opened += 1
            await self._stream.accepted()
        return await self._stream.send(request)

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None


async def serve_relay_stream(
    requests: AsyncIterator[pb.RelayRequest],
    context: grpc.aio.ServicerContext,
    events_of: Events,
    refusals: tuple[type[Exception], ...],
    max_deadline_s: float,
    on_request: Callable[[], None] = lambda: None,
    closing: asyncio.Event | None = None,
) -> AsyncIterator[pb.RelayEvent]:
    """A node's side of one RelayStream: each request runs as its own task (`events_of`, node/relay.py's
    Relayer.relay with the node's hop), their events interleaved on the way out. `refusals` are the
    exceptions (with a `.code`) that refuse one request and leave the stream open. Once `closing` is set
    (the node drains), new requests are refused UNAVAILABLE and the stream ends when its chains have:
    a stream lives as long as its sender, and a draining node must not wait its whole grace for it."""
    served = _ServedStream(events_of, refusals, max_deadline_s, closing or asyncio.Event())
    await context.send_initial_metadata((ACCEPTED,))
    helpers = [
        asyncio.create_task(served.take_requests(requests, on_request), name="relay stream requests"),
        asyncio.create_task(served.end_when_drained(), name="relay stream drain"),
    ]
    for helper in helpers:
        helper.add_done_callback(_log_crash)
    try:
        while (event := await served.out.get()) is not None:
            yield event
    finally:
        for task in [*helpers, *served.tasks.values()]:
            task.cancel()
        await asyncio.gather(*helpers, *served.tasks.values(), return_exceptions=True)


class _ServedStream:
    """The node's state for one RelayStream: its requests' tasks and their outgoing events (None ends it)."""

    def __init__(
        self, events_of: Events, refusals: tuple[type[Exception], ...], max_deadline_s: float, closing: asyncio.Event
    ) -> None:
        self.events_of, self.refusals, self.max_deadline_s, self.closing = events_of, refusals, max_deadline_s, closing
        # Bounded: a sender that writes requests but never reads their events stops being read from.
        self.out: asyncio.Queue[pb.RelayEvent | None] = asyncio.Queue(maxsize=2 * MAX_STREAM_IN_FLIGHT)
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def take_requests(self, requests: AsyncIterator[pb.RelayRequest], on_request: Callable[[], None]) -> None:
        try:
            async for request in requests:
                on_request()
                rid = request.forward.request_id
                if self.closing.is_set():
                    await self.out.put(_refused(rid, grpc.StatusCode.UNAVAILABLE, "the node is shutting down"))
                elif rid in self.tasks:
                    await self.out.put(
                        _refused(rid, grpc.StatusCode.ALREADY_EXISTS, "request id already in flight here")
                    )
                elif len(self.tasks) >= MAX_STREAM_IN_FLIGHT:
                    await self.out.put(
                        _refused(rid, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many chains on one stream")
                    )
                else:
                    self.tasks[rid] = asyncio.create_task(self.run_one(request), name=f"relay {rid[:32]}")
        except BaseException:  # logged by _log_crash (a cancellation is not); the events side ends too
            with contextlib.suppress(asyncio.QueueFull):
                self.out.put_nowait(None)
            raise
        await asyncio.gather(*self.tasks.values())  # the sender is done writing: finish its chains (they never raise)
        await self.out.put(None)

    async def run_one(self, request: pb.RelayRequest) -> None:
        rid = request.forward.request_id

        async def put_events() -> None:
            async for event in self.events_of(request):
                await self.out.put(event)

        try:
            await asyncio.wait_for(put_events(), _bounded(request.deadline_s, self.max_deadline_s) + LATE_GRACE_S)
        except self.refusals as exc:
            await self.out.put(pb.RelayEvent(request_id=rid, refused=exc.code.name, handback_reason=str(exc)))  # type: ignore[attr-defined]
        except asyncio.TimeoutError:  # not the builtin before Python 3.11 (Jetson images run 3.10)
            await self.out.put(_refused(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "the chain's deadline passed here"))
        except Exception:  # a bug here must not leave the sender waiting until its deadline
            log.exception("relay %s failed", rid)
            await self.out.put(_refused(rid, grpc.StatusCode.INTERNAL, "the node failed to relay this chain"))
        finally:
            self.tasks.pop(rid, None)

    async def end_when_drained(self) -> None:
        await self.closing.wait()
        while self.tasks:
            await asyncio.wait(list(self.tasks.values()))
        await self.out.put(None)


def _bounded(deadline_s: float, limit: float) -> float:
    """A sender's deadline, never unbounded (Relayer.check refuses a bad one with its reason at once)."""
    return deadline_s if math.isfinite(deadline_s) and 0 < deadline_s <= limit else 1.0


def _refused(rid: str, code: grpc.StatusCode, reason: str) -> pb.RelayEvent:
    return pb.RelayEvent(request_id=rid, refused=code.name, handback_reason=reason)
