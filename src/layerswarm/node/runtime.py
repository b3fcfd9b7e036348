"""One block on one device, run off the event loop, with load accounting and micro-batching.

The block is computed by an engine (engines/: torch's modules or numpy's); this module sees numpy arrays
only, so a node's runtime is the same whichever engine computes.

Compute runs on one worker thread: concurrent requests queue instead of thrashing the cores. With
micro-batching on, the requests that queued up while the block was busy (same position, up to
`max_batch` rows) run as one batch and are split again afterwards: no waiting window is added, so
a lone request pays nothing, and under load the block runs fewer, larger matrix products.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from layerswarm.models.manifest import AnyManifest
from layerswarm.wire.stats import ewma

from .engines import BlockEngine

R = TypeVar("R")


@dataclass
class _Pending:
    x: np.ndarray
    position: int
    done: asyncio.Future[tuple[np.ndarray, float]]


class BlockRuntime:
    EWMA_ALPHA = 0.2

    def __init__(
        self,
        engine: BlockEngine,
        index: int,
        manifest: AnyManifest,
        micro_batch: bool = True,
        max_batch: int = 64,
    ) -> None:
        self.engine = engine
        # A decoder block (generation): Forward runs it over whole sequences from position 0, without a
        # cache; its streams' steps go through decode_batch.py on the same compute thread.
        self.decoder = engine.decoder
        self.manifest = manifest
        self.index = index
        self.device = engine.device
        self.dtype = np.float32  # what every engine computes in
        self.micro_batch = micro_batch
        self.max_batch = max_batch
        self.in_flight = 0  # queued or computing
        self.served = 0
        self.batches = 0  # block invocations (fewer than `served` when micro-batching merges requests)
        self.ewma_ms = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"block{index}")
        self._queue: deque[_Pending] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._busy = False  # a batch is computing: new requests queue up to be merged

    async def forward(
        self, x: np.ndarray, position: int, token_mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, float]:
        """The block's output: (B, T, D), or with a text token mask the active tokens' states only (N, D)."""
        self.in_flight += 1
        try:
            if token_mask is not None:  # text with per-token masks: shapes differ per request, no merging
                loop = asyncio.get_running_loop()
                out, ms = await loop.run_in_executor(self._pool, self._compute_tokens, x, position, token_mask)
                self.batches += 1
            elif self.micro_batch:
                out, ms = await self._batched(x, position)
            else:
                out, ms = await asyncio.get_running_loop().run_in_executor(self._pool, self._compute, x, position)
                self.batches += 1
        finally:
            self.in_flight -= 1
        self.served += 1
        self.ewma_ms = ewma(self.ewma_ms if self.served > 1 else None, ms, self.EWMA_ALPHA)
        return out, ms

    async def on_thread(self, fn: Callable[..., R], *args: object) -> R:
        """Run `fn(*args)` on the block's one compute thread (decode steps share it with Forward)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def begin_call(self) -> None:
        """A call (a decode step) is queued or computing: counted in `in_flight` until end_call."""
        self.in_flight += 1

    def end_call(self, ms: float | None) -> None:
        """The call ended; `ms`: its compute time when it was served (for Info's load figures)."""
        self.in_flight -= 1
        if ms is not None:
            self.served += 1
            self.ewma_ms = ewma(self.ewma_ms if self.served > 1 else None, ms, self.EWMA_ALPHA)

    async def _batched(self, x: np.ndarray, position: int) -> tuple[np.ndarray, float]:
        """An idle block runs a request at once, from the caller's own coroutine: a lone request pays
        for no batcher task (its creation and wake-ups, on every hop). Requests that arrive while the
        block is busy queue up and are merged."""
        if self._busy or self._queue:
            return await self._enqueue(x, position)
        self._busy = True
        try:
            out, ms = await asyncio.get_running_loop().run_in_executor(self._pool, self._compute, x, position)
            self.batches += 1
        finally:
            self._busy = False
            self._start_batcher()
        return out, ms

    def _enqueue(self, x: np.ndarray, position: int) -> asyncio.Future[tuple[np.ndarray, float]]:
        pending = _Pending(x, position, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        self._start_batcher()
        return pending.done

    def _start_batcher(self) -> None:
        """Drain the queue in a task, unless the block is busy: whoever holds it starts one when done."""
        if self._queue and not self._busy and (self._worker is None or self._worker.done()):
            self._worker = asyncio.get_running_loop().create_task(self._drain(), name=f"block{self.index}-batcher")

    async def _drain(self) -> None:
        self._busy = True
        try:
            await self._drain_queue()
        finally:
            self._busy = False

    async def _drain_queue(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            group = self._take_group()
            try:
                x = group[0].x if len(group) == 1 else np.concatenate([p.x for p in group])
                out, ms = await loop.run_in_executor(self._pool, self._compute, x, group[0].position)
            except Exception as exc:  # noqa: BLE001 - every waiter must hear about the failure
                for p in group:
                    if not p.done.done():
                        p.done.set_exception(exc)
                continue
            self.batches += 1
            start = 0
            for p in group:
                rows = p.x.shape[0]
                if not p.done.done():  # the caller may have given up (cancelled)
                    p.done.set_result((out[start : start + rows], ms))
                start += rows

    def _take_group(self) -> list[_Pending]:
        """The oldest request, plus queued ones at the same position while they fit in max_batch."""
        first = self._queue.popleft()
        group, rows = [first], first.x.shape[0]
        kept: deque[_Pending] = deque()
        while self._queue:
            p = self._queue.popleft()
            same_kind = p.x.dtype == first.x.dtype and p.x.shape[1:] == first.x.shape[1:]  # text T varies
            fits = p.position == first.position and same_kind and rows + p.x.shape[0] <= self.max_batch
            if fits:
                group.append(p)
                rows += p.x.shape[0]
            else:
                kept.append(p)
        self._queue = kept
        return group

    def _compute_tokens(self, x: np.ndarray, position: int, token_mask: np.ndarray) -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        out = self.engine.forward_tokens(x, position, token_mask)  # text classifiers (a decoder refuses masks)
        return out, (time.perf_counter() - started) * 1e3

    def _compute(self, x: np.ndarray, position: int) -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        out = self.engine.forward(x, position)
        return out, (time.perf_counter() - started) * 1e3

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
