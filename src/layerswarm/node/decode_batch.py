"""Continuous batching at a decoder node: concurrent streams' steps as one block call.

The style of runtime.py: one compute thread (the runtime's), an idle block runs a step at once from its
caller's coroutine (a lone stream pays no batching delay), and steps that arrive while the block is busy
queue up; when it is free, the queued steps with the same number of new tokens T (and the same kind:
computed, or kv_only) run as one call of up to `max_batch` rows, each row against its own cache
(the engine attends row by row, each against its own cache), and are split again.

Why only equal T: every T = 1 decode step of every stream merges, which is what continuous batching is
for; a prefill or a verify (T > 1) merges with others of its own T (a speculative route's verifies all
have k + 1). Padding rows to the longest T computes the padding: seven steps and a 64-token prefill took
4.2x as long as one call per T (docs/results/decode-node.json); four steps with four verifies of 4 were
about even (padded 12% faster in that run), too little to pay for the rule's complexity.

A step's CALM fill (keys and values of earlier tokens that left the route before this block) goes into
its cache first, in the same worker call, so its tokens follow at start + F.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .engines import BlockEngine, EngineCache

log = logging.getLogger(__name__)


@dataclass
class DecodeStep:
    cache: EngineCache  # the stream's, already rolled back to the step's start
    x: np.ndarray  # (1, T, D) in the block's dtype
    fill: np.ndarray | None = None  # (1, F, D): keys and values only, before x
    kv_only: bool = False  # x's keys and values only: no output

    @property
    def key(self) -> tuple[int, bool]:
        return self.x.shape[1], self.kv_only


@dataclass
class StepResult:
    out: np.ndarray | None  # (1, T, D); None for kv_only
    compute_ms: float
    batched: int  # steps in the block call this one ran in


@dataclass
class _Queued:
    step: DecodeStep
    done: asyncio.Future[StepResult] = field(repr=False)


Computed = tuple[list[np.ndarray | None], float]  # one output per step (None: kv_only), milliseconds
OnThread = Callable[[Callable[[list[DecodeStep]], Computed], list[DecodeStep]], Awaitable[Computed]]


class DecodeBatcher:
    def __init__(
        self,
        engine: BlockEngine,
        on_thread: OnThread,
        max_batch: int,
        on_call: Callable[[int], None] = lambda steps: None,
    ) -> None:
        self.engine = engine
        self.on_thread = on_thread  # runs a function on the node's one compute thread
        self.max_batch = max_batch
        self.on_call = on_call  # told each block call's number of steps (the batch size metric)
        self.calls = 0  # block calls (fewer than steps when steps merged)
        self._queue: deque[_Queued] = deque()
        self._busy = False
        self._held = 0  # hold()s not yet released: steps queue, as if the block were busy
        self._worker: asyncio.Task[None] | None = None

    def idle(self) -> bool:
        """Nothing computing or queued, nor held: a step may run at once."""
        return not self._busy and not self._queue and not self._held

    def hold(self) -> None:
        """Queue the steps that come from now on until release(), so that steps known to come together (one
        DecodeBatch message's, decode_calls.py) run as one block call, not the first alone."""
        self._held += 1

    def release(self) -> None:
        self._held -= 1
        if not self._held:
            self._start_batcher()

    def step_inline(self, step: DecodeStep) -> StepResult:
        """An idle block's step, computed here, on the caller's (the event loop's) thread: no hand-off to
        the compute thread and back. Only for a step too small to hold the loop up, and only when no other
        stream could have batched with it (decode.py decides)."""
        assert self.idle()
        (out,), ms = self.compute([step])
        self.calls += 1
        self.on_call(1)
        return StepResult(out, ms, 1)

    async def step(self, step: DecodeStep) -> StepResult:
        return await self.submit(step)

    def submit(self, step: DecodeStep) -> asyncio.Future[StepResult]:
        """The step queued, or started at once when the block is idle; its result to come. Synchronous,
        so that the steps submitted in one event-loop turn are all queued by its end."""
        if self._busy or self._queue or self._held:
            queued = _Queued(step, asyncio.get_running_loop().create_future())
            self._queue.append(queued)
            self._start_batcher()
            return queued.done
        self._busy = True
        return asyncio.ensure_future(self._alone(step))

    async def _alone(self, step: DecodeStep) -> StepResult:
        try:
            (out,), ms = await self.on_thread(self.compute, [step])
            self.calls += 1
            self.on_call(1)
        finally:
            self._busy = False
            self._start_batcher()
        return StepResult(out, ms, 1)

    def _start_batcher(self) -> None:
        if self._queue and not self._busy and not self._held and (self._worker is None or self._worker.done()):
            self._worker = asyncio.get_running_loop().create_task(self._drain(), name="decode-batcher")

    async def _drain(self) -> None:
        self._busy = True
        try:
            while self._queue:
                group = self._take_group()
                try:
                    outs, ms = await self.on_thread(self.compute, [q.step for q in group])
                except Exception as exc:
                    log.exception("decode batch of %d steps failed", len(group))
                    for q in group:
                        if not q.done.done():
                            q.done.set_exception(exc)
                    continue
                self.calls += 1
                self.on_call(len(group))
                for q, out in zip(group, outs, strict=True):
                    if not q.done.done():  # its caller may have given up
                        q.done.set_result(StepResult(out, ms, len(group)))
        finally:
            self._busy = False
            self._start_batcher()  # a step queued while the last group's results were handed out

    def _take_group(self) -> list[_Queued]:
        """The oldest step, plus queued ones of the same kind while they fit in max_batch."""
        first = self._queue.popleft()
        group, kept = [first], deque[_Queued]()
        while self._queue:
            q = self._queue.popleft()
            (group if q.step.key == first.step.key and len(group) < self.max_batch else kept).append(q)
        self._queue = kept
        return group

    def compute(self, steps: list[DecodeStep]) -> Computed:
        """On the compute thread: fills, then every step's tokens as one block call (rows of one T)."""
        started = time.perf_counter()
        for s in steps:
            if s.fill is not None:
                self.engine.append_kv(s.fill, [s.cache])
        caches = [s.cache for s in steps]
        x = steps[0].x if len(steps) == 1 else np.concatenate([s.x for s in steps])
        outs: Sequence[np.ndarray | None]
        if steps[0].kv_only:
            self.engine.append_kv(x, caches)
            outs = [None] * len(steps)
        else:
            out = self.engine.decode(x, caches)
            outs = [out[row : row + 1] for row in range(len(steps))]
        return list(outs), (time.perf_counter() - started) * 1e3

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
