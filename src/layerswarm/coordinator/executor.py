"""Pushes activations through a planned path, hop by hop, routing around whatever fails.

Per hop: try the planned node; on an error, timeout or malformed reply, try the same block index on
another node (another model of the family); for shuffle-robust families, any block not used yet; when
nothing can stand in, skip the hop. The request fails only if fewer than `min_blocks` blocks ran.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from layerswarm.wire import codec

from .clients import ClientPool
from .hop_call import HopCaller, HopFailed, HopResult
from .peer_check import same_weights
from .planner import Plan, substitutes
from .ranges import hard_range_problem
from .registry import NodeRecord, Registry
from .verify import Lie, Verifier
from .wire_choice import WireChoice

log = logging.getLogger(__name__)


@dataclass
class Attempt:
    node: str
    model_id: str | None
    block: int
    error: str


@dataclass
class Hop:
    position: int
    planned_block: int
    block: int | None = None  # the block that actually ran (None: skipped)
    node: str | None = None
    model_id: str | None = None
    latency_ms: float = 0.0
    outcome: str = "ok"  # ok | hedged (a second node answered first) | substituted | skipped | relayed
    hedged_to: str | None = None  # the node a slow hop was also sent to
    repeat: bool = False  # a block index that already ran, run again on purpose (too few indices reachable)
    attempts: list[Attempt] = field(default_factory=list)
    send_ms: float | None = None  # relayed hops: forwarding to the next node (less its compute)
    tokens: int | None = None  # text: tokens this hop computed (frozen ones only read)
    wire_bytes: int | None = None  # text: tensor payload bytes of request and reply
    wire: str | None = None  # --wire-dtype auto: the dtype this hop's link was sent in

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["latency_ms"] = round(self.latency_ms, 3)
        for key in ("tokens", "wire_bytes", "wire"):  # image traces keep their keys
            if data[key] is None:
                data.pop(key)
        return data


@dataclass
class PathResult:
    activations: torch.Tensor
    hops: list[Hop]
    unreachable: list[int]
    exited_early: bool = False
    anytime: bool = False  # answered early because the deadline left no time for the next hop
    topology: str = "star"  # star | relay (coordinator/relay.py)
    # relay chains that ended early: kind (not_started | handed_back | discarded), after_step, reason
    handbacks: list[dict[str, Any]] = field(default_factory=list)
    chains: int = 0  # relay chains started (each ends complete or in one hand-back)
    network: dict[str, Any] | None = None  # network-aware plan: predicted vs actual time

    @property
    def depth(self) -> int:
        return sum(1 for h in self.hops if h.block is not None)

    def topology_trace(self) -> dict[str, Any]:
        """Relay chains' hand-backs and the network-aware plan, for the request's trace."""
        data: dict[str, Any] = {"topology": self.topology, "handbacks": self.handbacks}
        if self.network is not None:
            data["network"] = self.network
        return data


class DepthError(RuntimeError):
    """Fewer blocks ran than the request's minimum depth: the coordinator answers 503 with this."""


@dataclass
class ExecOptions:
    hop_timeout_s: float
    deadline: float  # absolute time.monotonic() by which the path must be done
    min_blocks: int
    shuffle_robust: bool
    wire_dtype: torch.dtype
    spec: codec.TensorSpec
    request_id: str
    early_exit: Callable[[torch.Tensor], Awaitable[bool]] | None = None  # True: confident enough to stop
    # the caller's budget (deadline_ms): once min depth ran, answer with what ran rather than start a hop
    # that would end past it; below min depth it does not cut (the request `deadline` still does)
    anytime_deadline: float | None = None
    anytime_reserve_ms: float = 5.0  # kept free for the head and the reply
    hedge_quantile: float | None = None  # hedge a hop slower than this quantile of the node's latency
    hedge_min_ms: float = 10.0  # ... but never sooner than this
    first_position: int = 0  # position of the first hop (a relay run continuing a path part-way)
    used_blocks: frozenset[int] = frozenset()  # block indices that already ran earlier in the path
    force_verify: bool = False  # re-execute every hop (a hop sampled out of a relay chain)
    path_length: int | None = None  # blocks in the whole path (None: this plan's)
    key_mask: torch.Tensor | None = None  # text: (B, T) True for real tokens; hops carry a token mask
    token_depth: torch.Tensor | None = None  # text: (B, T) hops each token runs before it freezes
    wire_choice: WireChoice | None = None  # --wire-dtype auto: per link (wire_dtype is then fp16, for relays)
    frozen_dtype: torch.dtype | None = None  # text: frozen tokens travel apart in this dtype (None: with the rest)


DEADLINE_REACHED = "request deadline reached"
_Won = tuple[NodeRecord, HopResult, float]  # the node that answered, its reply, latency in ms


def _hedge_delay(record: NodeRecord, opts: ExecOptions) -> float | None:
    """Seconds to wait for `record` before hedging; None: do not hedge (off, or too few samples yet)."""
    if opts.hedge_quantile is None:
        return None
    quantile = record.latency_quantile(opts.hedge_quantile)
    return None if quantile is None else max(quantile, opts.hedge_min_ms) / 1e3


def _next_hop_fits(candidates: list[NodeRecord], opts: ExecOptions) -> bool:
    """Can the next hop finish within the caller's budget? Judged by its fastest candidate's recent
    latency; a hop with no latency history yet is tried only while the budget lasts."""
    if opts.anytime_deadline is None:
        return True
    left_ms = (opts.anytime_deadline - time.monotonic()) * 1e3
    known = [r.ewma_ms for r in candidates if r.routable and r.ewma_ms is not None]
    return (min(known) if known else 0.0) + opts.anytime_reserve_ms <= left_ms


@dataclass
class _RequestState:
    """What one request's hops share: options, its random source, and what ran or failed so far."""

    opts: ExecOptions
    rng: random.Random
    used: set[int] = field(default_factory=set)  # block indices that ran
    failed: set[str] = field(default_factory=set)  # nodes that failed: not tried again for this request
    planned_later: set[int] = field(default_factory=set)  # block indices still ahead in the plan
    path_length: int = 0  # blocks in the planned path (sent to nodes: informational)


class PathExecutor:
    def __init__(self, registry: Registry, pool: ClientPool, verifier: Verifier | None = None) -> None:
        self.registry = registry
        self.hops = HopCaller(registry, pool)
        self.verifier = verifier  # None: replies are only checked for form (codec), not for truth
        self._stragglers: set[asyncio.Future[_Won | None]] = set()  # hedge losers left to finish

    async def run(self, x: torch.Tensor, plan: Plan, opts: ExecOptions, rng: random.Random) -> PathResult:
        hops: list[Hop] = []
        length = opts.path_length if opts.path_length is not None else len(plan.steps)
        state = _RequestState(opts, rng, used=set(opts.used_blocks), path_length=length)
        for step_index, step in enumerate(plan.steps):
            position = opts.first_position + sum(1 for h in hops if h.block is not None)
            hop = Hop(position=position, planned_block=step.block, repeat=step.repeat)
            hops.append(hop)
            if step.block in state.used and not step.repeat:  # a substitute already ran this block index
                hop.outcome = "skipped"
                continue
            if position >= opts.min_blocks and not _next_hop_fits(step.candidates, opts):
                hops.pop()
                return PathResult(x, hops, plan.unreachable, anytime=True)
            state.planned_later = {s.block for s in plan.steps[step_index + 1 :]}
            out = await self._run_hop(x, hop, step.candidates, state)
            if out is not None:
                x = out
                if await self._exits(x, opts, position + 1, step_index + 1 < len(plan.steps)):
                    return PathResult(x, hops, plan.unreachable, exited_early=True)
        path = PathResult(x, hops, plan.unreachable)
        if path.depth < opts.min_blocks:
            raise DepthError(
                f"only {path.depth} blocks could run (minimum {opts.min_blocks}); "
                f"unreachable blocks {plan.unreachable}, "
                f"skipped {[h.planned_block for h in hops if h.block is None]}"
            )
        return path

    @staticmethod
    async def _exits(x: torch.Tensor, opts: ExecOptions, depth: int, more_planned: bool) -> bool:
        """Ask the exit rule after every hop (patience counts every hop); stop only past min depth."""
        if opts.early_exit is None or not more_planned:
            return False
        return await opts.early_exit(x) and depth >= opts.min_blocks

    async def _run_hop(
        self, x: torch.Tensor, hop: Hop, candidates: list[NodeRecord], state: _RequestState
    ) -> torch.Tensor | None:
        alternatives = self._alternatives(hop, candidates, state)
        for record in alternatives:
            if time.monotonic() >= state.opts.deadline:
                hop.attempts.append(Attempt(record.address, None, record.block, DEADLINE_REACHED))
                break
            won = await self._hedged(x, hop, record, alternatives, state)
            if won is None:
                continue
            winner, result, latency_ms = won
            self.registry.record_success(winner.address, latency_ms)
            hop.block, hop.node, hop.latency_ms = winner.block, winner.address, latency_ms
            hop.model_id = winner.identity.model_id if winner.identity else None
            hop.outcome = "substituted" if hop.attempts else "hedged" if hop.hedged_to == winner.address else "ok"
            state.used.add(winner.block)
            if state.opts.wire_choice is not None:
                hop.wire = codec.dtype_name(result.wire)
            if result.tokens is not None:  # text: what the winner's hop computed and moved
                hop.tokens, hop.wire_bytes = result.tokens, result.wire_bytes
            return result.out
        hop.outcome = "skipped"
        return None

    async def _hedged(
        self, x: torch.Tensor, hop: Hop, record: NodeRecord, alternatives: Iterator[NodeRecord], state: _RequestState
    ) -> _Won | None:
        """Call `record`; once it is slower than its hedge delay (a high quantile of its own recent
        latencies), send the same activations to the next alternative as well: the first answer wins
        and the other call is cancelled. Shuffle-robust families make many nodes eligible."""
        primary = asyncio.ensure_future(self._attempt(record, x, hop, state))
        delay = _hedge_delay(record, state.opts)
        if delay is None:
            return await primary
        done, _ = await asyncio.wait({primary}, timeout=delay)
        backup_record = None if done else next(alternatives, None)
        if backup_record is None:
            return await primary
        hop.hedged_to = backup_record.address
        pending = {primary, asyncio.ensure_future(self._attempt(backup_record, x, hop, state))}
        try:
            while pending:
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    if task.result() is not None:
                        return task.result()
            return None
        finally:
            for task in pending:
                self._let_finish(task)

    def _let_finish(self, loser: asyncio.Future[_Won | None]) -> None:
        """A hedge's losing call runs to its end (bounded by the hop timeout) instead of being cancelled:
        cancelling a grpc.aio call while its read is in flight leaks native memory (grpc/grpc#43360),
        and the loser's real latency is what keeps its hedge delay honest."""
        self._stragglers.add(loser)
        loser.add_done_callback(self._straggler_done)

    def _straggler_done(self, loser: asyncio.Future[_Won | None]) -> None:
        self._stragglers.discard(loser)
        if loser.cancelled():
            return
        if (exc := loser.exception()) is not None:  # _attempt turns call failures into None: this is a bug
            log.error("a hedge's losing call raised", exc_info=exc)
            return
        won = loser.result()
        if won is not None:
            record, _result, latency_ms = won
            self.registry.record_success(record.address, latency_ms)

    async def close(self) -> None:
        """Cancel hedge losers still running (the coordinator is stopping)."""
        for task in list(self._stragglers):
            task.cancel()
        await asyncio.gather(*self._stragglers, return_exceptions=True)

    async def _attempt(self, record: NodeRecord, x: torch.Tensor, hop: Hop, state: _RequestState) -> _Won | None:
        """One call; a failure goes into the trace and the registry, and gives None."""
        started = time.monotonic()
        try:
            result = await self._call(record, x, hop, state)
        except HopFailed as exc:
            state.failed.add(record.address)
            ident = record.identity
            hop.attempts.append(Attempt(record.address, ident.model_id if ident else None, record.block, str(exc)))
            if exc.quarantine:
                self.registry.quarantine(record.address, str(exc), exc.evidence)
            else:
                self.registry.record_failure(record.address, str(exc))
            return None
        return record, result, (time.monotonic() - started) * 1e3

    def _alternatives(self, hop: Hop, candidates: list[NodeRecord], state: _RequestState) -> Iterator[NodeRecord]:
        """Planned candidates first; then (robust families) nodes of spare block indices. Nodes that
        failed earlier in this request are passed over."""
        tried = state.failed
        for record in candidates:
            if record.routable and record.address not in tried:
                yield record
        if state.opts.shuffle_robust:
            by_block = self.registry.routable_by_block()
            reserved = state.planned_later | {hop.planned_block}
            for _block, record in substitutes(by_block, state.used, reserved, state.rng, tried):
                if record.routable and record.address not in tried:
                    yield record

    async def _call(self, record: NodeRecord, x: torch.Tensor, hop: Hop, state: _RequestState) -> HopResult:
        result = await self.hops.forward(record, x, hop.position, state.opts, state.path_length)
        await self._verify(record, x, result, hop.position, state)
        return result

    async def _verify(
        self, record: NodeRecord, x: torch.Tensor, result: HopResult, position: int, state: _RequestState
    ) -> None:
        """Blame the node whose reply is wrong, before its output reaches the next (honest) hop."""
        opts = state.opts
        if self.verifier is None:
            hard = hard_range_problem(result.out, position, result.wire)
            if hard is not None:
                log.warning("quarantining %s: %s", record.address, hard)
                raise HopFailed(f"reply out of range: {hard['discrepancy']}", quarantine=True, evidence=hard)
            return

        async def ask(peer: NodeRecord) -> torch.Tensor | None:
            """The same hop on a replica (a referee): its reply, or None when it gave none usable."""
            try:
                return (await self.hops.forward(peer, x, position, opts, state.path_length)).out  # judged as sent
            except HopFailed as exc:
                log.info("referee %s gave no usable answer: %s", peer.address, exc)
                return None

        def replicas() -> list[NodeRecord]:  # only when the hop is re-executed: a scan of every node
            return [
                r for r in same_weights(record, list(self.registry.nodes.values())) if r.address not in state.failed
            ]

        try:
            await self.verifier.check(
                record,
                x,
                result.out,
                position,
                result.wire,
                force=opts.force_verify,
                token_mask=result.token_mask,
                sent=result.sent,
                replicas=replicas,
                ask=ask,
            )
        except Lie as exc:
            raise HopFailed(str(exc), quarantine=True, evidence=exc.evidence) from exc
