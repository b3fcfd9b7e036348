"""Generation at a decoder node: Decode, DecodeStream and Release (docs/generation.md).

    DecodeRequest -> checks (stream id, start, shapes, dtypes, finite, in range: checks.py)
      -> StreamTable.claim (the caller owns it, or start 0 opens it: streams.py)
      -> the stream's lock (its steps run one at a time, in arrival order)
      -> StreamTable.begin (roll back to start, context, bytes) -> DecodeBatcher.step (decode_batch.py)
      -> output check -> StreamTable.done (a failure rolls the cache back) -> DecodeResponse

DecodeStream and DecodeBatchStream (decode_calls.py) run their steps concurrently through `decode`, so
that their streams' steps batch; the streams opened over one are freed when it ends, and an idle sweep
(a supervised background loop) frees streams no step has touched for idle_timeout_s.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

import grpc
import numpy as np

from layerswarm.models.lm.config import LMConfig
from layerswarm.wire import arrays
from layerswarm.wire.memory import give_back_free_memory
from layerswarm.wire.periodic import Periodic
from layerswarm.wire.stats import ewma
from layerswarm.wire.v1 import block_pb2 as pb

from .checks import RequestError, check_input_range, decoded, output_problem, reply_dtype_of
from .decode_batch import DecodeBatcher, DecodeStep, StepResult
from .engines import EngineCache
from .metrics import NodeMetrics
from .runtime import BlockRuntime
from .settings import NodeSettings
from .streams import EVICTION_REASONS, Caller, Limits, Stream, StreamError, StreamTable

log = logging.getLogger(__name__)

NOT_A_DECODER = (
    "not a decoder block: Decode, DecodeStream, DecodeBatchStream and Release serve generative (lm) families"
)
STREAM_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # the coordinator's are 32 hex digits
SWEEPS_PER_TIMEOUT = 4  # the idle sweep runs this often per idle timeout (a stream lives at most 1.25x it)
# Freed cache bytes after which the sweep gives the heap's free pages back to the kernel (when no step is
# running): the allocator keeps freed memory for reuse (wire/memory.py), so without this a node's RSS stays
# at its busiest moment's after a burst of streams.
TRIM_AFTER_BYTES = 16 * 1024 * 1024
# A lone stream's short step (one token, or a speculative verify of up to INLINE_MAX_TOKENS) whose recent
# steps of that size computed in at most INLINE_MAX_MS runs on the event loop (no hand-off to the compute
# thread and back: two thread wake-ups a step, docs/generation.md "where a token's time goes"). Longer
# steps, prefills, and any step while another stream is open (it could batch) use the thread.
INLINE_MAX_MS = 2.0
INLINE_MAX_TOKENS = 17  # a verify of k + 1 tokens, k at most 16 (the coordinator's limit)
INLINE_EWMA_ALPHA = 0.2


@dataclass(frozen=True)
class Asked:
    """A checked request's step, before any stream is touched."""

    x: np.ndarray  # (1, T, D) in the block's dtype
    fill: np.ndarray | None  # (1, F, D)
    kv_only: bool
    reply_dtype: int  # a wire dtype (wire/arrays.py)

    @property
    def tokens(self) -> int:
        """What the step adds to the stream's cache: F + T."""
        return self.x.shape[1] + (self.fill.shape[1] if self.fill is not None else 0)


class DecodeService:
    def __init__(self, runtime: BlockRuntime, settings: NodeSettings, metrics: NodeMetrics) -> None:
        cfg = runtime.manifest.config
        engine = runtime.engine
        if not isinstance(cfg, LMConfig) or not engine.decoder:
            raise TypeError("DecodeService serves decoder blocks only")
        self.runtime, self.settings, self.metrics = runtime, settings, metrics
        self.dim = cfg.dim
        self.limits = Limits(
            max_streams=settings.max_streams,
            max_seq_len=cfg.max_seq_len,
            max_cache_bytes=settings.max_cache_bytes,
            idle_timeout_s=settings.idle_timeout_s,
        )
        self.table: StreamTable[EngineCache] = StreamTable(
            self.limits, engine.new_cache, engine.kv_bytes_per_token, on_free=self._freed
        )
        self.batcher = DecodeBatcher(engine, runtime.on_thread, settings.max_batch, on_call=metrics.batch_size.observe)
        self.spec = arrays.TensorSpec((1, None, cfg.dim), max_batch=1, max_bytes=settings.max_message_bytes)
        interval = min(max(settings.idle_timeout_s / SWEEPS_PER_TIMEOUT, 0.05), 5.0)
        self.sweeper = Periodic("idle-stream-sweep", interval, self._sweep)
        self.freed_bytes = 0  # cache bytes freed since the heap was last trimmed
        # Recent lone steps' compute by their number of tokens (an EWMA each): may the next of that size run inline?
        self.step_ms: dict[int, float] = {}
        self.inline_steps = 0  # steps computed on the event loop (_inline)
        self.trims = 0
        full = self.table.bytes_per_token * engine.new_cache().capacity_after(cfg.max_seq_len)
        if full > self.limits.max_cache_bytes:
            log.warning(
                "max_cache_mib %.3g holds less than one stream at the full context (%d bytes): long streams "
                "will be refused with RESOURCE_EXHAUSTED",
                settings.max_cache_mib,
                full,
            )
        for reason in EVICTION_REASONS:  # every label at 0 from the start: rate() sees the first one
            metrics.evictions.labels(reason)

    def start(self) -> None:
        self.sweeper.start()

    async def stop(self) -> None:
        await self.sweeper.stop()
        self.batcher.close()
        self.table.clear()

    def limits_message(self) -> pb.StreamLimits:
        return pb.StreamLimits(
            max_streams=self.limits.max_streams,
            max_seq_len=self.limits.max_seq_len,
            max_cache_bytes=self.limits.max_cache_bytes,
            idle_timeout_s=self.limits.idle_timeout_s,
        )

    # -- the RPCs ------------------------------------------------------------------------------------

    async def decode(self, request: pb.DecodeRequest, caller: Caller) -> pb.DecodeResponse:
        """One step; raises RequestError with the status to answer."""
        asked = self._checked(request)
        if self.runtime.in_flight >= self.settings.max_in_flight:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"node busy: {self.runtime.in_flight} requests in flight (limit {self.settings.max_in_flight})",
            )
        stream = self._claim(request.stream_id, caller, request.start)
        self.runtime.begin_call()
        self.metrics.in_flight.inc()
        ms: float | None = None
        try:
            reply = await self._step(stream, request, asked)
            ms = reply.compute_ms
        finally:
            self.metrics.in_flight.dec()
            self.runtime.end_call(ms)
            self.observe()
        self.metrics.steps.labels(_kind(request.start, asked)).inc()
        self.metrics.latency.observe(reply.compute_ms / 1e3)
        return reply

    async def _step(self, stream: Stream[EngineCache], request: pb.DecodeRequest, asked: Asked) -> pb.DecodeResponse:
        """A claimed stream's step, under its lock (begin and done too: the rollback point is this step's).
        The claim is matched by exactly one table.done, whatever happens."""
        if stream.serial is None:
            stream.serial = asyncio.Lock()
        done = False
        try:
            async with stream.serial:
                began = ok = False
                try:
                    self.table.begin(stream, request.start, asked.tokens)
                    began = True
                    result = await self._computed(DecodeStep(stream.cache, asked.x, asked.fill, asked.kv_only))
                    reply = self._reply(request, stream, result, asked.reply_dtype)
                    ok = True
                    return reply
                except StreamError as exc:
                    raise _refusal(exc) from None
                finally:
                    self.table.done(stream, ok, began, release=ok and request.release)
                    done = True
        finally:
            if not done:  # cancelled while it waited for the lock
                self.table.done(stream, ok=False, began=False)

    async def _computed(self, step: DecodeStep) -> StepResult:
        """The step through the batcher. A caller that goes away (cancelled) still waits for its step's
        compute to end before the stream's lock is let go: the compute thread writes that cache."""
        tokens = step.x.shape[1]
        short = tokens <= INLINE_MAX_TOKENS and step.fill is None
        try:
            if short and self._inline(tokens):
                result = self.batcher.step_inline(step)
                self.inline_steps += 1
            else:
                pending = self.batcher.submit(step)
                try:
                    result = await asyncio.shield(pending)
                except asyncio.CancelledError:
                    await asyncio.wait([pending])
                    raise
        except (RuntimeError, MemoryError) as exc:  # a device error, out of memory: the caller must see why
            log.exception("decode step failed")
            raise RequestError(grpc.StatusCode.INTERNAL, f"block compute failed: {exc}") from exc
        if short and result.batched == 1:
            self.step_ms[tokens] = ewma(self.step_ms.get(tokens), result.compute_ms, INLINE_EWMA_ALPHA)
        return result

    def _inline(self, tokens: int) -> bool:
        """Whether a short step of `tokens` may compute on the event loop: steps of its size are known to be
        quick, this stream is the only one here (no other could batch with it) and nothing else is
        computing or queued."""
        quick = self.step_ms.get(tokens, INLINE_MAX_MS + 1) <= INLINE_MAX_MS
        return quick and len(self.table) <= 1 and self.runtime.in_flight <= 1 and self.batcher.idle()

    def release(self, request: pb.ReleaseRequest, caller: Caller) -> pb.ReleaseResponse:
        for stream_id in request.stream_ids:
            _check_stream_id(stream_id)
        try:
            released = self.table.release(request.stream_ids, caller)
        except StreamError as exc:
            raise _refusal(exc) from None
        finally:
            self.observe()
        return pb.ReleaseResponse(released=released)

    # -- inside --------------------------------------------------------------------------------------

    def _checked(self, request: pb.DecodeRequest) -> Asked:
        """The step a request asks for, every field checked; nothing is touched yet."""
        _check_stream_id(request.stream_id)
        if request.start < 0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"start {request.start} is negative")
        if not request.HasField("activations"):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request has no activations")
        reply_dtype = reply_dtype_of(request.reply_dtype, request.activations.dtype)
        x = decoded(request.activations, self.spec, "activations")
        check_input_range(x, reply_dtype)
        fill = None
        if request.HasField("fill"):
            fill = decoded(request.fill, self.spec, "fill")
            check_input_range(fill, reply_dtype, "fill states")
        tokens = x.shape[1] + (fill.shape[1] if fill is not None else 0)
        if request.start + tokens > self.limits.max_seq_len:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"stream {request.stream_id} would hold {request.start + tokens} tokens; "
                f"the context is {self.limits.max_seq_len}",
            )
        dtype = self.runtime.dtype
        x = x.astype(dtype, copy=False)
        return Asked(x, fill.astype(dtype, copy=False) if fill is not None else None, request.kv_only, reply_dtype)

    def _claim(self, stream_id: str, caller: Caller, start: int) -> Stream[EngineCache]:
        try:
            return self.table.claim(stream_id, caller, start)
        except StreamError as exc:
            raise _refusal(exc) from None
        finally:
            self.observe()

    def _reply(
        self, request: pb.DecodeRequest, stream: Stream[EngineCache], result: StepResult, reply_dtype: int
    ) -> pb.DecodeResponse:
        reply = pb.DecodeResponse(
            stream_id=request.stream_id,
            compute_ms=result.compute_ms,
            length=stream.cache.length,
            batched=result.batched,
        )
        if result.out is not None:
            problem = output_problem(result.out, reply_dtype)
            if problem is not None:  # the input was in range (checked first): this node is at fault
                self.metrics.refused_outputs.inc()
                log.warning("refusing to send block output: %s", problem)
                raise RequestError(grpc.StatusCode.INTERNAL, f"block output {problem}: not sent")
            reply.activations.CopyFrom(arrays.encode(result.out, reply_dtype))
        return reply

    async def _sweep(self) -> None:
        expired = self.table.expire()
        if expired:
            log.info("freed %d streams idle for more than %g s", expired, self.limits.idle_timeout_s)
            self.observe()
        enough = self.freed_bytes >= TRIM_AFTER_BYTES or (self.freed_bytes and len(self.table) == 0)
        if enough and self.runtime.in_flight == 0:
            freed, self.freed_bytes = self.freed_bytes, 0
            started = time.perf_counter()
            await self.runtime.on_thread(give_back_free_memory)
            self.trims += 1
            log.debug("gave free heap memory back after %d freed cache bytes (%.1f ms)", freed, _ms_since(started))

    def _freed(self, stream: Stream[EngineCache], reason: str) -> None:
        self.freed_bytes += stream.cache.nbytes
        if reason in EVICTION_REASONS:
            self.metrics.evictions.labels(reason).inc()
        else:
            self.metrics.released.inc()

    def observe(self) -> None:
        stats = self.table.stats()
        self.metrics.streams_open.set(stats.streams)
        self.metrics.cache_bytes.set(stats.booked_bytes)
        self.metrics.tokens_held.set(stats.tokens)


def _check_stream_id(stream_id: str) -> None:
    if not STREAM_ID.fullmatch(stream_id):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "stream_id must be 1 to 128 letters, digits or _.:- (the coordinator's: 32 hex digits)",
        )


def _refusal(exc: StreamError) -> RequestError:
    return RequestError(grpc.StatusCode[exc.code], str(exc))


def _kind(start: int, asked: Asked) -> str:
    if asked.kv_only:
        return "kv_only"
    if start == 0:
        return "prefill"
    return "step" if asked.x.shape[1] == 1 else "verify"


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1e3
