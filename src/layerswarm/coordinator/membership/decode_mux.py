"""Every generation stream's steps to one node over one shared DecodeBatchStream call (docs/wire.md).

A stream's call per node made a token round of S streams over a route of H nodes S x H gRPC messages,
and their per-message cost, not the block compute, bounded throughput. Here one DecodeMux per NodeClient
(shared by all the streams of this coordinator process) collects the steps submitted in one event-loop
turn (it sends them from a loop.call_soon callback, so a lone stream waits for nothing) into one
DecodeBatch message, and hands each stream its reply from the DecodeBatchReply:

    MuxLink.step(request) -> DecodeMux.step: queued  -> (the turn ends) _flush: one DecodeBatch, its timer
                          <- its reply, or RefusedInStream for its step  <- _read: the replies, in order

The node runs one call's steps concurrently (they batch into one block call) and keeps a stream's steps
in order; every stream opened over the call belongs to it and is freed when it ends. So a failure of
the call is every waiting stream's, and each gets what a stream's own DecodeStream call (decode_links.py:
DecodeLink) raised in that case, which the runner already turns into a rebuild or a failover:

    no reply in time     the call is cancelled (the node frees its streams); every step waiting on it
                         gets asyncio.TimeoutError at once: one deadline per call, not one per stream (a
                         message's timer: the longest of its steps', and never before the timer of the
                         message ahead of it, whose reply must come first)
    the client closed    (the pool dropped the node: it stopped answering and is no longer advertised, as
                         in a restart) UNAVAILABLE at once, for the steps waiting and every later one; a
                         step that cannot be sent (the call cannot be opened) fails the same way, never
                         waits without a timer
    the call failed      its grpc.aio.AioRpcError (UNAVAILABLE, ...); a call that ended with OK, or a
                         reply that does not match its message: UNAVAILABLE / INTERNAL, the call dropped
    a step refused       RefusedInStream for that step; the call goes on

The next step opens a new call, and the node answers it NOT_FOUND or FAILED_PRECONDITION for a stream the
old call opened (a rebuild). A node without DecodeBatchStream (UNIMPLEMENTED: nothing ran) is asked no
more: each MuxLink falls back to a DecodeLink of its own. A step whose caller was cancelled before its
message went is left out of it; after, its reply is dropped (its stream's next step sets `start`, and the
node truncates to it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc

from layerswarm.wire.discovery import MAX_DECODE_BATCH_STEPS
from layerswarm.wire.v1 import block_pb2 as pb

from .decode_links import DecodeClient, DecodeLink, refused_in_stream
from .rpc import unavailable

log = logging.getLogger(__name__)

Failure = Callable[[], BaseException]  # a fresh exception per waiting step
# A reply held back (_answered) waits for the ones after it at most HOLD_RTTS times its own message's round
# trip, and at least MIN_HOLD_S (a message of many steps takes longer than one of a few; a loaded machine
# deschedules a node for milliseconds), and only for messages whose steps add at most HOLD_MAX_TOKENS tokens
# each (decode steps, short verifies): never for a prefill's.
HOLD_RTTS = 8.0
MIN_HOLD_S = 0.005
HOLD_MAX_TOKENS = 8


class Unsupported(Exception):
    """The node has no DecodeBatchStream (it answered UNIMPLEMENTED before running anything)."""


@dataclass(eq=False)
class _Step:
    request: pb.DecodeRequest
    timeout: float
    done: asyncio.Future[pb.DecodeResponse]


@dataclass(eq=False)
class _Sent:
    """A message whose reply is due."""

    call: Any
    steps: list[_Step]
    timeout: float  # the longest of its steps'
    at: float  # when it went (the loop's clock)
    deadline: float  # when it is given up (the loop's clock): see _flush
    small: bool  # no step adds more than HOLD_MAX_TOKENS tokens: a reply may wait for it
    timer: asyncio.TimerHandle | None = None


class DecodeMux:
    def __init__(self, client: DecodeClient, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        self.client = client
        self.max_message_bytes = max_message_bytes  # a message is split before it would pass half of it
        self.supported = True  # False once the node answered UNIMPLEMENTED
        self.messages = 0  # DecodeBatch messages sent
        self.steps = 0  # steps sent in them
        self.calls = 0  # DecodeBatchStream calls opened
        self.closed = False  # the client closed (its channel is gone): every step fails at once
        self._call: Any = None
        self._outbox: asyncio.Queue[pb.DecodeBatch | None] | None = None  # what the call's request iterator sends
        self._reader: asyncio.Task[None] | None = None
        self._waiting: list[_Step] = []  # submitted this turn
        self._flush_at: asyncio.Handle | None = None
        self._sent: deque[_Sent] = deque()  # oldest first
        # Replies held back so that their streams go on together with those of the messages in flight
        # after theirs (see _answered); while _hold_timer is set.
        self._held: list[tuple[_Step, pb.DecodeResponse]] = []
        self._hold_timer: asyncio.TimerHandle | None = None
        self.held = 0  # replies held back, ever (for the tests and the curious)

    async def step(self, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
        """One stream's step over the shared call. Raises RefusedInStream, grpc.aio.AioRpcError,
        asyncio.TimeoutError past `timeout`, or Unsupported (the node has no DecodeBatchStream)."""
        if not self.supported:
            raise Unsupported
        if self.closed:  # a stream's link outlived the client (the pool dropped it): this node is gone for it
            raise unavailable("the node's client closed")
        loop = asyncio.get_running_loop()
        step = _Step(request, timeout, loop.create_future())
        self._waiting.append(step)
        if self._flush_at is None:
            self._flush_at = loop.call_soon(self._flush)
        return await step.done

    def _flush(self) -> None:
        """The turn's steps (less those whose callers went away) as one message, or a few. A callback:
        whatever goes wrong here is the steps' failure, never an exception nobody sees (which would leave
        them waiting for ever: a step has no timer until its message went)."""
        self._flush_at = None
        steps = [s for s in self._waiting if not s.done.done()]
        self._waiting = []
        if not steps:
            return
        try:
            self._send(steps)
        except grpc.aio.AioRpcError as exc:  # not signed: the node has not proved itself (yet)
            _settle(steps, partial(_copy, exc))
        except grpc.aio.UsageError as exc:  # the channel closed under us: the node is gone for us
            _settle(steps, partial(unavailable, f"decode steps not sent: {exc}"))
        except Exception as exc:  # a bug: the steps fail (INTERNAL), and the loop logs it
            _settle(steps, partial(_internal, f"decode steps not sent: {type(exc).__name__}: {exc}"))
            raise

    def _send(self, steps: list[_Step]) -> None:
        if not self.supported:
            _settle(steps, Unsupported)
            return
        if self.closed:
            _settle(steps, lambda: unavailable("the node's client closed"))
            return
        if self._call is None:
            self._open()
        assert self._outbox is not None
        loop = asyncio.get_running_loop()
        for chunk in self._chunks(steps):
            self._outbox.put_nowait(pb.DecodeBatch(steps=[s.request for s in chunk]))
            small = all(_tokens(s.request) <= HOLD_MAX_TOKENS for s in chunk)
            timeout, now = max(s.timeout for s in chunk), loop.time()
            # Replies come in order: one cannot come before the reply to the message ahead of it, so a
            # message is not given up (and the call with every stream on it dropped) before that one is.
            # A few decode steps sent behind a long prefill wait for it, as they must, not for their own
            # timeout alone.
            deadline = max(now + timeout, self._sent[-1].deadline if self._sent else 0.0)
            sent = _Sent(self._call, chunk, timeout, at=now, deadline=deadline, small=small)
            sent.timer = loop.call_at(deadline, self._expire, sent)
            self._sent.append(sent)
            self.messages += 1
            self.steps += len(chunk)

    def _chunks(self, steps: list[_Step]) -> list[list[_Step]]:
        """At most MAX_DECODE_BATCH_STEPS steps, and about half the message limit, a message."""
        if len(steps) == 1:
            return [steps]
        chunks: list[list[_Step]] = [[]]
        size, limit = 0, self.max_message_bytes // 2
        for s in steps:
            n = s.request.ByteSize()
            if chunks[-1] and (len(chunks[-1]) >= MAX_DECODE_BATCH_STEPS or size + n > limit):
                chunks.append([])
                size = 0
            chunks[-1].append(s)
            size += n
        return chunks

    def _open(self) -> None:
        metadata = self.client._signed("DecodeBatchStream")
        outbox: asyncio.Queue[pb.DecodeBatch | None] = asyncio.Queue()

        async def messages() -> Any:
            while (message := await outbox.get()) is not None:
                yield message

        call = self.client.block.DecodeBatchStream(messages(), metadata=metadata)
        self._call, self._outbox = call, outbox
        self.calls += 1
        self._reader = asyncio.get_running_loop().create_task(self._read(call), name="decode-mux-reader")

    async def _read(self, call: Any) -> None:
        """The call's replies, each to the oldest message's steps, until the call ends or is dropped."""
        try:
            while True:
                reply = await call.read()
                if call is not self._call:
                    return
                if reply is grpc.aio.EOF:
                    await self._ended(call)
                    return
                if not self._sent:
                    self._fail(call, lambda: _internal("the node sent a DecodeBatchReply nobody asked for"))
                    return
                sent = self._sent[0]
                if len(reply.replies) != len(sent.steps):
                    wrong = f"the node answered {len(reply.replies)} steps of a message of {len(sent.steps)}"
                    self._fail(call, partial(_internal, wrong))
                    return
                self._sent.popleft()
                _cancel(sent)
                self._answered(sent, reply)
        except grpc.aio.AioRpcError as exc:
            self._fail(call, partial(_copy, exc), exc)
        except asyncio.InvalidStateError as exc:  # the call ended under us (the node went away)
            self._fail(call, partial(unavailable, f"stream closed: {exc}"))
        except asyncio.CancelledError:
            cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+
            if call is not self._call or (cancelling is not None and cancelling()):
                raise  # close(), or a call we dropped: its steps have their failure already
            # grpc.aio cancels the calls on a channel that closed under them
            self._fail(call, lambda: unavailable("the call was cancelled under us: the channel to the node closed"))

    def _answered(self, sent: _Sent, reply: pb.DecodeBatchReply) -> None:
        """Hand a message's replies to its steps, or hold them back a while. Streams whose steps were sent
        in different messages (they started at different moments) would otherwise stay apart for good,
        each group a message per node per token: a message answered while later ones of decode steps are
        in flight to this node waits until none is (replies come in order), bounded by a timer (HOLD_*),
        and then all of them go on in the same event-loop turn, so that their next steps share one
        message. A lone stream never waits: nothing else is in flight."""
        answers = list(zip(sent.steps, reply.replies, strict=True))
        if self._hold_timer is None:
            if not self._small_in_flight():
                _hand(answers)
                return
            loop = asyncio.get_running_loop()
            self._hold_timer = loop.call_later(max(HOLD_RTTS * (loop.time() - sent.at), MIN_HOLD_S), self._release)
        self._held += answers
        self.held += len(answers)
        if not self._small_in_flight():
            self._release()

    def _small_in_flight(self) -> bool:
        return any(m.small for m in self._sent)

    def _release(self) -> None:
        held, self._held = self._held, []
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        _hand(held)

    async def _ended(self, call: Any) -> None:
        status = await call.code()
        if status is None or status is grpc.StatusCode.OK:
            self._fail(call, lambda: unavailable("decode batch stream closed by the node"))
            return
        exc = grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details=await call.details())
        self._fail(call, partial(_copy, exc), exc)

    def _expire(self, sent: _Sent) -> None:
        log.info("%s: no DecodeBatchReply within %.3g s: its call is cancelled", self.client.address, sent.timeout)
        self._fail(sent.call, asyncio.TimeoutError)

    def _fail(self, call: Any, failure: Failure, exc: grpc.aio.AioRpcError | None = None) -> None:
        """Drop the call (the node frees what was opened over it): every step waiting on it fails."""
        if call is None or call is not self._call:
            return
        if exc is not None:
            self.client._learn(exc)
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                log.info("%s has no DecodeBatchStream: one DecodeStream per stream", self.client.address)
                self.supported = False
                failure = Unsupported
        self._release()  # replies that came are good
        call.cancel()
        assert self._outbox is not None
        self._outbox.put_nowait(None)
        self._call = self._outbox = self._reader = None
        sent, self._sent = self._sent, deque()
        for message in sent:
            _cancel(message)
            _settle(message.steps, failure)

    def close(self) -> None:
        """The client is closing: every waiting step fails (UNAVAILABLE), and so does every later one."""
        self.closed = True
        reader = self._reader
        self._fail(self._call, lambda: unavailable("the node's client closed"))
        if reader is not None:
            reader.cancel()
        _settle(self._waiting, lambda: unavailable("the node's client closed"))
        self._waiting = []


class MuxLink:
    """One generation stream's steps to one node: over the node's shared DecodeMux, or, at a node without
    DecodeBatchStream, over a DecodeStream call of the stream's own (DecodeLink)."""

    def __init__(self, mux: DecodeMux) -> None:
        self.mux = mux
        self._own: DecodeLink | None = None

    async def step(self, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
        if self._own is None:
            try:
                return await self.mux.step(request, timeout)
            except Unsupported:  # nothing ran: the same step over a call of its own
                self._own = DecodeLink(self.mux.client)
        return await self._own.step(request, timeout)

    def close(self) -> None:
        """The stream is done with this node. Over the shared call nothing ends (the runner's Release
        frees the stream); its own call, if it has one, ends, and the node frees what it opened."""
        if self._own is not None:
            self._own.close()


def _tokens(request: pb.DecodeRequest) -> int:
    """The tokens a step adds to its stream (T, and F for a fill), from the tensors' stated shapes."""
    shape, fill = request.activations.shape, request.fill.shape
    return (shape[1] if len(shape) > 1 else 1) + (fill[1] if len(fill) > 1 else 0)


def _hand(answers: list[tuple[_Step, pb.DecodeResponse]]) -> None:
    for s, answer in answers:
        if s.done.done():  # its caller went away
            continue
        if answer.refused:
            s.done.set_exception(refused_in_stream(answer))
        else:
            s.done.set_result(answer)


def _settle(steps: list[_Step], failure: Failure) -> None:
    for s in steps:
        if not s.done.done():
            s.done.set_exception(failure())


def _cancel(sent: _Sent) -> None:
    if sent.timer is not None:
        sent.timer.cancel()


def _copy(exc: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(exc.code(), grpc.aio.Metadata(), exc.trailing_metadata(), details=exc.details())


def _internal(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
