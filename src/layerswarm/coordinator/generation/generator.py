"""A decoder family's streams, from open to release: the coordinator's side of generation.

    open(prompt, options)  checked (options.py), a route planned (routes.py): a StreamSession
    prefill(session)       every prompt token through the route once
    tokens(session)        then one token per step: sample (models/lm/generate.py: the monolith's own
                           Sampling and pick_next, so the same seed gives the same text), show what
                           stops.py allows, feed the token back through the route (runner.py); or,
                           with speculation on, a local draft and one verify trip per round
                           (speculate.py)
    close(session)         Release on every node that may hold the stream's cache, whatever ended it
                           (finished, failed, the client went away): in a task of its own, so a
                           cancelled HTTP response still frees the nodes

The stem and the head run here, on one thread beside the event loop; the blocks run on the nodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import secrets
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import torch

from layerswarm.models import policy
from layerswarm.models.checkpoint import TOKENIZER, Manifest, load_stem_head, verified_file
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.generate import pick_next
from layerswarm.models.lm.tokenizer import check_tokenizer, decode, load_tokenizer
from layerswarm.wire.stats import ewma

from ..membership.clients import ClientPool
from ..membership.registry import Registry
from ..membership.watch import SwarmWatch
from ..routing.trace import DepthError
from ..settings import CoordinatorSettings
from ..verification.decode_check import DecodeVerifier
from .decode_call import DecodeCaller
from .exits import ExitCheck, calibrated, resolve, top_probability
from .options import GenerationOptions, InvalidGeneration, check_generation, parse_early_exit, parse_speculation
from .releases import Releases
from .routes import block_order, eligible, plan_route
from .rows import RowLog
from .runner import RouteRules, StreamRunner
from .session import Delta, RouteSlot, StreamSession, StreamView
from .speculate import Speculator, draft_plan, load_drafter
from .stops import TextStream

log = logging.getLogger(__name__)

RECENT_STREAMS = 16  # finished streams kept for the page
# A one-token stem or head call that takes at most this long runs on the event loop (_step_local): it holds
# the loop up less than the thread hand-off costs (about 0.13 ms a call, docs/generation-coordinator.md).
LOCAL_INLINE_MAX_MS = 0.5
# A lone speculative stream's draft (k tokens through the draft's blocks) or verdict that takes at most this
# long runs on the event loop: nothing else waits on the loop, and it saves two thread wake-ups a call.
LOCAL_SHORT_MAX_MS = 5.0
T = TypeVar("T")


class StreamObserver(Protocol):
    """Who counts what streams did (metrics.py: CoordinatorMetrics), above generation: handed in."""

    def stream_opened(self) -> None: ...

    def stream_closed(self, outcome: str, tokens: int) -> None: ...

    def token_step(self, seconds: float) -> None: ...

    def failover(self, kind: str) -> None: ...

    def speculation_round(self, drafted: int, accepted: int) -> None: ...

    def block_hops(self, hops: int, exits: int) -> None: ...

    def route_trips(self, trips: int) -> None: ...


def _timed(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """module(x) under inference mode (torch's mode is per thread), and how long it took in ms."""
    started = time.perf_counter()
    with torch.inference_mode():
        out = module(x)
    return out, (time.perf_counter() - started) * 1e3


def _timed_call(fn: Callable[[], T]) -> tuple[T, float]:
    """fn() and how long it took in ms (the caller sets inference mode)."""
    started = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - started) * 1e3


def generation_min_depth(settings: CoordinatorSettings, manifest: Manifest[LMConfig]) -> int:
    """Blocks a stream's route keeps: --min-blocks, else the evaluated minimum depth, else all of them
    (a family nobody evaluated never skips a block mid-stream)."""
    if settings.min_blocks is not None:
        if settings.min_blocks > manifest.config.depth:
            raise ValueError(f"--min-blocks {settings.min_blocks} is past the model's depth of {manifest.config.depth}")
        return settings.min_blocks
    evaluated = policy.min_blocks(manifest)
    return evaluated if evaluated is not None else manifest.config.depth


class Generator:
    def __init__(
        self,
        settings: CoordinatorSettings,
        manifest: Manifest[LMConfig],
        registry: Registry,
        pool: ClientPool,
        watch: SwarmWatch,
        verifier: DecodeVerifier | None,
        wire: torch.dtype,
        observer: StreamObserver | None = None,
    ) -> None:
        self.settings = settings
        self.manifest = manifest
        self.config = manifest.config
        self.registry = registry
        self.pool = pool
        self.watch = watch
        self.verifier = verifier
        self.wire = wire
        self.observer = observer
        self.min_depth = generation_min_depth(settings, manifest)
        self.stem, self.head = load_stem_head(settings.model_dir, manifest)
        self.tokenizer = load_tokenizer(verified_file(settings.model_dir, manifest, TOKENIZER))
        check_tokenizer(self.tokenizer, self.config, str(settings.model_dir))
        rules = RouteRules(manifest.model_id, self.config.shuffle_robust, self.min_depth, settings.prefill_chunk_tokens)
        calls = DecodeCaller(pool, wire, self.config.dim, settings.hop_timeout_s)
        failover = observer.failover if observer is not None else None
        self.releases = Releases(pool)
        self.runner = StreamRunner(calls, pool, registry, verifier, rules, self.open_streams, self.releases, failover)
        self.live: dict[str, StreamSession] = {}
        self.recent: deque[StreamSession] = deque(maxlen=RECENT_STREAMS)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stem-head")
        self._step_ms: dict[int, float] = {}  # the stem's and the head's one-token calls, by module (EWMA)
        self.default_speculation = parse_speculation(settings.speculation)
        self.default_exit = parse_early_exit(settings.early_exit)
        self.calibrated_exit = calibrated(manifest)
        if self.default_exit.on and self.default_exit.threshold is None and self.calibrated_exit.threshold is None:
            raise ValueError("--early-exit on: this model has no calibrated threshold (`layerswarm eval`); give one")
        self.speculator: Speculator | None = None
        plan = draft_plan(settings, manifest)
        if plan is not None:
            load = functools.partial(load_drafter, settings, manifest, plan, self.stem, self.head)
            self.speculator = Speculator(
                load, self.runner, self.stem, self.head, self._run, observer, plan.prior, self._run_short
            )
            log.info("speculation %s, drafts %d blocks deep (%s)", settings.speculation, plan.depth, plan.source)
        log.info("generation: routes keep at least %d of %d blocks", self.min_depth, self.config.depth)

    def depth_ready(self) -> tuple[bool, str]:
        """Whether a stream can be opened now (enough blocks have a node that may serve ours), and why."""
        robust, own = self.config.shuffle_robust, self.manifest.model_id
        served = sum(
            any(eligible(r, own, robust) for r in records) for records in self.registry.routable_by_block().values()
        )
        need, depth = self.min_depth, self.config.depth
        if served >= need:
            return True, f"{served} of {depth} blocks can serve streams (minimum {need})"
        return False, f"only {served} of {depth} blocks can serve streams, minimum depth is {need}"

    # --- text ----------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """The prompt's ids: <s> (when the model has one) and the text's tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.config.bos_id] if self.config.bos_id >= 0 else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return decode(self.tokenizer, ids)

    # --- streams -------------------------------------------------------------------------------------

    async def open(self, prompt: Sequence[int], options: GenerationOptions) -> StreamSession:
        """A stream with its route planned. Raises InvalidGeneration (the request) and DepthError (too
        few blocks reachable for the minimum depth)."""
        limit = check_generation(
            prompt, options, self.config, self.settings.max_new_tokens, self.settings.default_max_tokens
        )
        await self.watch.wait_first_round(self.settings.request_timeout_s / 2)
        options, exit_rule = resolve(options, self.default_exit, self.default_speculation, self.calibrated_exit)
        if options.speculation is not None and options.speculation.on and self.speculator is None:
            raise InvalidGeneration("speculation needs a model of 2 blocks or more", "speculation", "no_draft")
        sampling = options.sampling()
        if not sampling.greedy and sampling.seed is None:  # a seed of our own, answered: the text can be had again
            options = dataclasses.replace(options, seed=random.SystemRandom().randrange(2**31))
            sampling = options.sampling()
        blocks = block_order(self.config.depth, options.order, random.Random(options.seed))
        nodes = plan_route(
            self.registry.routable_by_block(),
            blocks,
            self.manifest.model_id,
            self.config.shuffle_robust,
            self.open_streams(),
        )
        served = sum(node is not None for node in nodes)
        if served < self.min_depth:
            missing = [b for b, n in zip(blocks, nodes, strict=True) if n is None]
            raise DepthError(
                f"only {served} of {len(blocks)} blocks can serve a stream now (minimum {self.min_depth}); "
                f"no node for blocks {missing}"
            )
        dim = self.config.dim
        route = [
            RouteSlot(i, b, RowLog(dim, self.wire), node=n) for i, (b, n) in enumerate(zip(blocks, nodes, strict=True))
        ]
        session = StreamSession(
            id=secrets.token_hex(16),
            request_id=secrets.token_hex(6),
            prompt=list(prompt),
            options=options,
            limit=limit,
            route=route,
            final=RowLog(dim, self.wire),
            text=TextStream(self.decode, options.stop),
            sampling=sampling,
            rng=None if sampling.greedy else sampling.generator(),
            eos_id=self.config.eos_id,
        )
        session.exits.rule = exit_rule
        self.live[session.id] = session
        if self.observer is not None:
            self.observer.stream_opened()
        return session

    async def prefill(self, s: StreamSession) -> torch.Tensor:
        """Every prompt token through the route: the logits (1, V) the first token is drawn from.
        Raises StreamFailed."""
        x = await self._local(self.stem, torch.tensor([s.prompt]))
        ask = s.options.speculation
        if ask is not None and ask.on and self.speculator is not None:
            return await self.speculator.prefill(s, x, ask)
        out = await self.runner.advance(s, x, 0)
        s.trips += 1
        return await self._local(self.head, out[:, -1])

    async def tokens(self, s: StreamSession, logits: torch.Tensor) -> AsyncIterator[Delta]:
        """The stream's tokens from the prefill's logits on, until it finishes. Raises StreamFailed."""
        if self.speculator is not None and s.id in self.speculator.drafts:
            async for delta in self.speculator.tokens(s, logits):
                yield delta
            return
        rule = s.exits.rule
        exit = ExitCheck(rule, self._confidence) if rule is not None else None
        while True:
            token = int(pick_next(logits, s.sampling, s.rng)[0])
            text, finish = s.accept(token)
            yield Delta(text, None if token == s.eos_id else token, finish)
            if finish is not None:
                s.finish_reason = finish
                return
            started = time.monotonic()
            x = await self._step_local(self.stem, torch.tensor([[token]]))
            out = await self.runner.advance(s, x, s.length - 1, exit)
            s.trips += 1
            logits = await self._step_local(self.head, out[:, -1])
            if self.observer is not None:
                self.observer.token_step(time.monotonic() - started)

    def close(self, s: StreamSession, error: str | None = None) -> None:
        """The stream ended (finished, failed, or its client went away): free its caches on every node
        that may hold them, in a task of its own (this may run in a cancelled response). Idempotent."""
        if s.closed:
            return
        s.closed, s.error, s.finished_at = True, error, time.monotonic()
        self.live.pop(s.id, None)
        self.recent.appendleft(s)
        outcome = "finished" if s.finish_reason is not None else "failed" if error else "abandoned"
        if self.speculator is not None:
            self.speculator.forget(s)
        if self.observer is not None:
            self.observer.stream_closed(outcome, len(s.generated))
            self.observer.route_trips(s.trips)
            self.observer.block_hops(s.exits.block_hops, s.exits.exits)
        for link in s.links.values():
            link.close()
        s.links.clear()
        self.releases.free(s.id, s.request_id, s.holders | s.dropped)
        s.dropped.clear()

    async def releases_done(self, timeout: float | None = None) -> None:
        """Wait (bounded) for the releases under way."""
        await self.releases.wait(timeout)

    def open_streams(self) -> Counter[str]:
        """Our live streams per node address (the planner keeps within each node's stated limit)."""
        held: Counter[str] = Counter()
        for s in self.live.values():
            for slot in s.route:
                if slot.node is not None and not slot.skipped:
                    held[slot.node.address] += 1
        return held

    def views(self) -> tuple[list[StreamView], list[StreamView]]:
        """Live streams and the latest finished ones, for the page."""
        now = time.monotonic()
        return [s.view(now) for s in self.live.values()], [s.view(now) for s in self.recent]

    async def _confidence(self, x: torch.Tensor) -> float:
        return await self._run(lambda: top_probability(self.head, x))

    async def _local(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return await self._run(lambda: module(x))

    async def _step_local(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The stem or the head for one token: on the event loop when its recent calls took at most
        LOCAL_INLINE_MAX_MS (the hand-off to the stem-and-head thread and back costs more than a small
        model's call), else on that thread."""
        key = id(module)
        quick = self._step_ms.get(key, LOCAL_INLINE_MAX_MS + 1) <= LOCAL_INLINE_MAX_MS
        out, ms = _timed(module, x) if quick else await self._run(lambda: _timed(module, x))
        self._step_ms[key] = ewma(self._step_ms.get(key), ms)
        return out

    async def _run_short(self, fn: Callable[[], T]) -> T:
        """A speculative round's draft or verdict: on the event loop while this is the only live stream (no
        other stream's I/O waits behind it) and such calls took at most LOCAL_SHORT_MAX_MS lately, else on
        the stem-and-head thread. The hand-off costs two thread wake-ups a call, twice a round."""
        key = id(fn.__code__)
        if len(self.live) > 1 or self._step_ms.get(key, LOCAL_SHORT_MAX_MS + 1) > LOCAL_SHORT_MAX_MS:
            out, ms = await self._run(lambda: _timed_call(fn))
        else:
            with torch.inference_mode():
                out, ms = _timed_call(fn)
        self._step_ms[key] = ewma(self._step_ms.get(key), ms)
        return out

    async def _run(self, fn: Callable[[], T]) -> T:
        """fn on the stem-and-head thread, under inference mode (torch's mode is per thread)."""

        def compute() -> T:
            with torch.inference_mode():
                return fn()

        return await asyncio.get_running_loop().run_in_executor(self._compute, compute)

    async def aclose(self) -> None:
        """The process is stopping: free every live stream's caches, and wait (bounded) for the releases."""
        for s in list(self.live.values()):
            self.close(s, "the coordinator is stopping")
        await self.releases_done()
        if self.verifier is not None:
            self.verifier.close()
        self._compute.shutdown(wait=False, cancel_futures=True)
