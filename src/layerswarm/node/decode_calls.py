"""A decoder node's long-lived generation calls: DecodeStream and DecodeBatchStream (docs/generation.md).

    DecodeStream        one step per message, one reply per step
    DecodeBatchStream   up to MAX_DECODE_BATCH_STEPS steps per message (DecodeBatch), one DecodeBatchReply
                        per message with its steps' replies in their order

Both carry many streams' steps from one coordinator. Messages are read and started as they come, answered
in order; a message's steps run concurrently (so that they batch into one block call, decode_batch.py),
and steps of one stream keep their order (its lock is taken in arrival order: decode.py). A failed step
is a reply with `refused` set, never the end of the call, since ending it frees every stream opened over
it (Caller.connection: a stream belongs to the call that opened it). A DecodeBatch of more steps than
the limit ends the call with INVALID_ARGUMENT before any of its steps runs (the replies owed for the
messages before it are sent first).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from layerswarm.wire.discovery import MAX_DECODE_BATCH_STEPS
from layerswarm.wire.v1 import block_pb2 as pb

from .checks import RequestError
from .decode import DecodeService
from .streams import Caller

log = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")
# Batches a DecodeBatchStream reads ahead of its replies: a coordinator keeps about one in flight per
# token round; the steps in them are bounded by max_in_flight all the same (decode.py).
BATCHES_AHEAD = 8


async def serve_stream(
    service: DecodeService, requests: AsyncIterator[pb.DecodeRequest], caller: Caller
) -> AsyncIterator[pb.DecodeResponse]:
    """DecodeStream: at most max_in_flight requests unanswered."""

    def start(request: pb.DecodeRequest) -> Awaitable[pb.DecodeResponse]:
        service.metrics.requests.labels("DecodeStream").inc()
        return asyncio.create_task(answer(service, request, caller))

    async for reply in _serve(service, requests, caller, start, service.settings.max_in_flight, "DecodeStream"):
        yield reply


async def serve_batches(
    service: DecodeService, batches: AsyncIterator[pb.DecodeBatch], caller: Caller
) -> AsyncIterator[pb.DecodeBatchReply]:
    """DecodeBatchStream. Raises RequestError (INVALID_ARGUMENT) at a message over the step limit."""

    def start(batch: pb.DecodeBatch) -> Awaitable[pb.DecodeBatchReply]:
        service.metrics.requests.labels("DecodeBatchStream").inc()
        steps = len(batch.steps)
        if steps > MAX_DECODE_BATCH_STEPS:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a DecodeBatch of {steps} steps; at most {MAX_DECODE_BATCH_STEPS} (none of them ran)",
            )
        service.metrics.batch_steps.inc(steps)
        return asyncio.create_task(_answer_batch(service, batch, caller))

    async for reply in _serve(service, batches, caller, start, BATCHES_AHEAD, "DecodeBatchStream"):
        yield reply


async def answer(service: DecodeService, request: pb.DecodeRequest, caller: Caller) -> pb.DecodeResponse:
    """A streamed step's reply: the step's, or its failure as a reply."""
    try:
        return await service.decode(request, caller)
    except RequestError as exc:
        code, error = exc.code, str(exc)
    except Exception as exc:  # a bug must not end the call (and free every stream on it) as UNKNOWN
        log.exception("decode step failed")
        code, error = grpc.StatusCode.INTERNAL, f"decode step failed: {type(exc).__name__}: {exc}"
    service.metrics.errors.labels(code.name).inc()
    return pb.DecodeResponse(stream_id=request.stream_id, refused=code.name, error=error)


async def _answer_batch(service: DecodeService, batch: pb.DecodeBatch, caller: Caller) -> pb.DecodeBatchReply:
    """Every step started at once, in order (a stream's steps queue on its lock in that order)."""
    steps = batch.steps
    if len(steps) == 1:  # a lone stream's step: no task of its own (it may compute inline, decode.py)
        return pb.DecodeBatchReply(replies=[await answer(service, steps[0], caller)])
    service.batcher.hold()
    try:
        tasks = [asyncio.ensure_future(answer(service, step, caller)) for step in steps]
        await asyncio.sleep(0)  # each task runs up to its step's place in the batcher's queue (or a lock's)
    finally:
        service.batcher.release()  # then they go as one block call (of each T)
    try:
        replies = await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for task in tasks:  # the steps end on their own (compute is not cancellable); take their outcome
            task.add_done_callback(_retrieve)
        raise
    return pb.DecodeBatchReply(replies=replies)


async def _serve(
    service: DecodeService,
    messages: AsyncIterator[In],
    caller: Caller,
    start: Callable[[In], Awaitable[Out]],
    ahead: int,
    method: str,
) -> AsyncIterator[Out]:
    """Messages read and started as they come (at most `ahead` unanswered), answered in order; on the
    way out (the caller closed the call, went away, or the node stops) the streams opened over it are
    freed. A message `start` refuses (RequestError) ends the call with that status, after the replies
    to the messages before it."""
    pending: asyncio.Queue[Awaitable[Out] | None] = asyncio.Queue(ahead)
    reader = asyncio.create_task(_read(messages, start, pending), name=f"{method}-reader")
    try:
        while (task := await pending.get()) is not None:
            yield await task
        await reader  # its error, if reading failed or a message was refused
    finally:
        reader.cancel()
        while not pending.empty():  # steps already started finish on their own (compute is not cancellable)
            left = pending.get_nowait()
            if isinstance(left, asyncio.Future):
                left.add_done_callback(_retrieve)
        assert caller.connection is not None
        freed = service.table.close_connection(caller.connection)
        if freed:
            log.info("%s ended: freed its %d streams", method, freed)
        service.observe()


async def _read(
    messages: AsyncIterator[In], start: Callable[[In], Awaitable[Out]], pending: asyncio.Queue[Awaitable[Out] | None]
) -> None:
    try:
        async for message in messages:
            await pending.put(start(message))
    finally:
        await pending.put(None)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """A finished step nobody will read (its call ended): take its outcome, so asyncio does not log it as
    never retrieved."""
    if not task.cancelled():
        task.exception()
