"""Pushes activations through a planned path, hop by hop, routing around whatever fails.

Per hop: try the planned node; on an error, timeout or malformed reply, try the same block index on
another node (another model of the family); for shuffle-robust families, any block not used yet; when
nothing can stand in, skip the hop. The request fails only if the path ran out with fewer than
`min_blocks` blocks (the readiness minimum, depth.py); a path the exit rule or the caller's deadline
ended (from their own floors on) is an answer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from layerswarm.wire import codec

from ..membership.clients import ClientPool
from ..membership.records import NodeRecord
from ..membership.registry import Registry
from ..settings import CoordinatorSettings
from ..verification.decisive import decisive_hops
from ..verification.peer_check import Ask, same_weights
from ..verification.ranges import hard_range_problem
from ..verification.verifier import Lie, Screened, Verifier
from .deferred import (
    MAX_REWINDS,
    Done,
    PendingCheck,
    PendingChecks,
    Rewind,
    Walk,
    confirmed,
    exit_state,
    restore_exit_state,
)
from .exits import RouteExit
from .hop_call import HopCaller, HopFailed, HopResult
from .planner import Plan, substitutes
from .request import Request
from .trace import Attempt, DepthError, Hop, PathResult
from .wire_choice import WireFormat

log = logging.getLogger(__name__)


DEADLINE_REACHED = "request deadline reached"
ANYTIME_RESERVE_MS = 5.0  # of the caller's budget, kept free for the head and the reply
# the node that answered, its reply, latency in ms, and its check (still to confirm unless `confirmed`)
_Won = tuple[NodeRecord, HopResult, float, Screened | None]
Head = Callable[[torch.Tensor], Awaitable[torch.Tensor]]  # the coordinator's own head: activations -> logits


def _next_hop_fits(candidates: list[NodeRecord], anytime_deadline: float | None) -> bool:
    """Can the next hop finish within the caller's budget? Judged by its fastest candidate's recent
    latency; a hop with no latency history yet is tried only while the budget lasts."""
    if anytime_deadline is None:
        return True
    left_ms = (anytime_deadline - time.monotonic()) * 1e3
    known = [r.ewma_ms for r in candidates if r.routable and r.ewma_ms is not None]
    return (min(known) if known else 0.0) + ANYTIME_RESERVE_MS <= left_ms


@dataclass(frozen=True)
class Resume:
    """Where a run picks up a route part-way (relay/chains.py runs its star steps one at a time): no
    minimum depth and no early exit of its own, the relay route keeps both."""

    position: int  # of the first hop
    used: frozenset[int]  # block indices that already ran in the route
    path_length: int  # blocks in the whole route
    force_verify: bool = False  # re-execute every hop (a hop the verifier drew out of a relay chain)
    later: frozenset[int] = frozenset()  # block indices the whole route still runs after this part
    avoid: frozenset[str] = frozenset()  # nodes the route left out (failed, or named by a hand-back)


@dataclass
class PathState:
    """One run of the executor: the request (read, never copied), this route's id, random source and
    exit rule, and what ran or failed so far. The one mutable state of a request's route."""

    request: Request
    route_id: str  # the request id the nodes see (an ensemble's routes are told apart)
    rng: random.Random
    early_exit: RouteExit | None  # None: no exit rule (or a relay route's star step)
    min_blocks: int  # a path that runs out below this depth fails (DepthError); 0 for a relay route's star step
    path_length: int  # blocks in the planned path (sent to nodes: informational)
    first_position: int = 0  # position of the first hop
    force_verify: bool = False  # re-execute every hop
    used: set[int] = field(default_factory=set)  # block indices that ran
    failed: set[str] = field(default_factory=set)  # nodes that failed: not tried again for this request
    planned_later: set[int] = field(default_factory=set)  # block indices still ahead in the plan
    route_later: frozenset[int] = frozenset()  # ... and in the route beyond it (a resumed part's: Resume.later)
    deferred: bool = False  # confirm checks while the path goes on (deferred.py); False: each blocks its hop
    checks: PendingChecks = field(default_factory=PendingChecks)


class PathExecutor:
    def __init__(
        self,
        registry: Registry,
        pool: ClientPool,
        verifier: Verifier | None,
        settings: CoordinatorSettings,
        wire: WireFormat,
    ) -> None:
        self.registry = registry
        self.hops = HopCaller(registry, pool, wire, settings.hop_timeout_s)
        self.verifier = verifier  # None: replies are only checked for form (codec), not for truth
        self.hedge_quantile = settings.hedge_quantile  # None: no hedging
        self.hedge_min_ms = settings.hedge_min_ms
        self._stragglers: set[asyncio.Future[Any]] = set()  # hedge losers (and their checks) left to finish

    async def run(
        self,
        x: torch.Tensor,
        plan: Plan,
        request: Request,
        route_id: str,
        rng: random.Random,
        early_exit: RouteExit | None = None,
        resume: Resume | None = None,
        head: Head | None = None,
    ) -> PathResult:
        """The plan walked from activations `x`: each hop's node, or another when it fails. Raises
        DepthError when the plan ran out before the request's minimum depth (never for a `resume`d step;
        never for a path its exit rule or deadline ended: those are answers).
        `head`: the coordinator's head, to find the answer's decisive hops (verification/decisive.py),
        which are re-executed before the path is returned."""
        state = PathState(
            request,
            route_id,
            rng,
            early_exit if resume is None else None,
            min_blocks=request.min_blocks if resume is None else 0,
            path_length=len(plan.steps) if resume is None else resume.path_length,
            first_position=0 if resume is None else resume.position,
            force_verify=resume is not None and resume.force_verify,
            used=set() if resume is None else set(resume.used),
            route_later=frozenset() if resume is None else resume.later,
            failed=set() if resume is None else set(resume.avoid),  # spares too pass them over
            deferred=self.verifier is not None and self.verifier.settings.deferred,
        )
        walk = Walk(x)
        try:
            while True:  # until every check of the path that answers has passed
                try:
                    path = await self._walk(walk, plan, state)
                    culprit = await state.checks.first_bad(state.checks.snapshot())
                    if culprit is None and head is not None and await self._check_decisive(walk, state, head):
                        culprit = await state.checks.first_bad(state.checks.snapshot())
                except Rewind as rewind:
                    culprit = rewind.check
                if culprit is None:
                    break
                self._rewind(walk, culprit, state)
        finally:
            state.checks.cancel_all()
        path.discarded = walk.discarded
        if path.depth < state.min_blocks and not (path.exited_early or path.anytime):
            skipped = [h.planned_block for h in path.hops if h.block is None]
            missing = sorted({*plan.unreachable, *skipped} - {h.block for h in path.hops})
            raise DepthError(
                f"only {path.depth} blocks could run (minimum {state.min_blocks}); no node answered for block "
                f"indices {missing} (unreachable when planned: {plan.unreachable}; skipped: {skipped})",
                missing,
            )
        return path

    def _hedge_delay(self, record: NodeRecord) -> float | None:
        """Seconds to wait for `record` before hedging; None: do not hedge (off, or too few samples yet)."""
        if self.hedge_quantile is None:
            return None
        quantile = record.latency_quantile(self.hedge_quantile)
        return None if quantile is None else max(quantile, self.hedge_min_ms) / 1e3

    async def _walk(self, walk: Walk, plan: Plan, state: PathState) -> PathResult:
        """The plan from `walk.step` on: hops, early exit, the caller's budget. Raises Rewind."""
        while walk.step < len(plan.steps):
            step_index, step = walk.step, plan.steps[walk.step]
            walk.step += 1
            position = state.first_position + sum(1 for h in walk.hops if h.block is not None)
            hop = walk.redo or Hop(position=position, planned_block=step.block, repeat=step.repeat)
            walk.redo = None
            walk.hops.append(hop)
            if step.block in state.used and not step.repeat:  # a substitute already ran this block index
                hop.outcome = "skipped"
                continue
            past_floor = position >= state.request.anytime_min_blocks  # the caller's budget may cut from here
            if past_floor and not _next_hop_fits(step.candidates, state.request.anytime_deadline):
                if hop.attempts:  # a hop rerun after a rewind: its failed attempts stay in the trace
                    hop.outcome = "skipped"
                else:
                    walk.hops.pop()
                return PathResult(walk.x, walk.hops, plan.unreachable, anytime=True)
            # A spare must not take a block the route runs later: that block would then be skipped at
            # its own step ("a substitute already ran this block index"), one block lost for one saved.
            state.planned_later = {s.block for s in plan.steps[step_index + 1 :]} | state.route_later
            used, saved_exit = frozenset(state.used), exit_state(state.early_exit)
            won = await self._run_hop(walk.x, hop, step.candidates, state)
            if won is not None:
                result, record, screened = won
                hop_index = len(walk.hops) - 1
                if screened is not None and not screened.confirmed:
                    task = self._confirm(screened)
                    check = PendingCheck(step_index, hop_index, hop, walk.x, record, used, saved_exit, task)
                    state.checks.add(check)
                done = Done(step_index, hop_index, hop, walk.x, record, used, saved_exit, result, screened is not None)
                walk.done.append(done)
                walk.x = result.out
                if await self._exits(walk.x, state, position + 1, step_index + 1 < len(plan.steps)):
                    return PathResult(walk.x, walk.hops, plan.unreachable, exited_early=True)
        return PathResult(walk.x, walk.hops, plan.unreachable)

    async def _check_decisive(self, walk: Walk, state: PathState, head: Head) -> bool:
        """Start the re-execution of the answer's decisive hops not checked yet (the hops that moved its
        prediction most: a lie that changes the answer has to be one of them); whether any was started.
        Always on our own copy where we hold one (verifier.py: decisive), whatever the mode."""
        verifier = self.verifier
        count = verifier.settings.decisive if verifier is not None else 0
        if verifier is None or count <= 0 or not walk.done or walk.done[0].result.token_mask is not None:
            return False  # text hops keep their own token masks: not ranked by a classification head
        stages = torch.cat([walk.done[0].x, *(d.result.out for d in walk.done)])  # ((H + 1) * B, T, D)
        batch = walk.done[0].x.shape[0]
        log_probs = (await head(stages)).float().log_softmax(-1).view(len(walk.done) + 1, batch, -1)
        started = False
        for index in decisive_hops(log_probs, count):
            done = walk.done[index]
            if done.checked:
                continue
            done.checked = True
            replicas, ask = self._referees(done.record, done.x, done.hop.position, state)
            result = done.result
            screened = verifier.decisive(
                done.record, done.x, result.out, done.hop.position, result.wire, result.sent, replicas, ask
            )
            if screened is None:
                continue
            if state.deferred:
                task = self._confirm(screened)
            else:  # checks block now (past MAX_REWINDS): confirmed here, its outcome kept as a finished task
                task = asyncio.get_running_loop().create_future()
                task.set_result(await confirmed(verifier, screened))
            state.checks.add(
                PendingCheck(done.step, done.hop_index, done.hop, done.x, done.record, done.used, done.exit_state, task)
            )
            started = True
        return started

    def _rewind(self, walk: Walk, culprit: PendingCheck, state: PathState) -> None:
        """`culprit`'s check failed: convict its node (a failed attempt of its hop, as a blocking check
        does), discard the hops after it and go back to its input, its step and what had run before it."""
        assert culprit.lie is not None and self.verifier is not None
        for check in (culprit, *state.checks.drop_from(culprit)):
            assert check.lie is not None
            lie = check.lie
            self._failed(check.record, check.hop, state, HopFailed(str(lie), lie.convict, lie.evidence, lie.convict))
        walk.back_to(culprit)
        state.used = set(culprit.used)
        restore_exit_state(state.early_exit, culprit.exit_state)
        self.verifier.counters.rewinds += 1
        state.checks.rewinds += 1
        if state.checks.rewinds >= MAX_REWINDS:
            state.deferred = False
        log.warning("%s: rewound to step %d: %s failed its check", state.route_id, culprit.step, culprit.record.address)

    @staticmethod
    async def _exits(x: torch.Tensor, state: PathState, depth: int, more_planned: bool) -> bool:
        """Ask the exit rule after every hop (patience counts every hop); it stops only from its floor on."""
        if state.early_exit is None or not more_planned:
            return False
        return await state.early_exit(x, depth)

    async def _run_hop(
        self, x: torch.Tensor, hop: Hop, candidates: list[NodeRecord], state: PathState
    ) -> tuple[HopResult, NodeRecord, Screened | None] | None:
        """The hop's reply, the node that gave it and its check still to confirm; None: skipped."""
        alternatives = self._alternatives(hop, candidates, state)
        before = state.checks.snapshot()
        for record in alternatives:
            if time.monotonic() >= state.request.deadline:
                hop.attempts.append(Attempt(record.address, None, record.block, DEADLINE_REACHED))
                break
            won = await self._hedged(x, hop, record, alternatives, state, before)
            if won is None:
                continue
            winner, result, latency_ms, screened = won
            self.registry.record_success(winner.address, latency_ms)
            hop.block, hop.node, hop.latency_ms = winner.block, winner.address, latency_ms
            hop.model_id = winner.identity.model_id if winner.identity else None
            hop.outcome = "substituted" if hop.attempts else "hedged" if hop.hedged_to == winner.address else "ok"
            state.used.add(winner.block)
            if self.hops.wire.choice is not None:
                hop.wire = codec.dtype_name(result.wire)
            if result.tokens is not None:  # text: what the winner's hop computed and moved
                hop.tokens, hop.wire_bytes = result.tokens, result.wire_bytes
            return result, winner, screened
        hop.outcome = "skipped"
        return None

    async def _hedged(
        self,
        x: torch.Tensor,
        hop: Hop,
        record: NodeRecord,
        alternatives: Iterator[NodeRecord],
        state: PathState,
        before: tuple[PendingCheck, ...],
    ) -> _Won | None:
        """Call `record`; once it is slower than its hedge delay (a high quantile of its own recent
        latencies), send the same activations to the next alternative as well: the first answer wins
        and the other call is cancelled. Shuffle-robust families make many nodes eligible."""
        primary = asyncio.ensure_future(self._attempt(record, x, hop, state, before))
        delay = self._hedge_delay(record)
        if delay is None:
            return await primary
        done, _ = await asyncio.wait({primary}, timeout=delay)
        backup_record = None if done else next(alternatives, None)
        if backup_record is None:
            return await primary
        hop.hedged_to = backup_record.address
        pending = {primary, asyncio.ensure_future(self._attempt(backup_record, x, hop, state, before))}
        try:
            while pending:
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    if task.result() is not None:
                        pending |= finished - {task}  # answered at the same time: a loser all the same
                        return task.result()
            return None
        finally:
            for task in pending:
                self._let_finish(task)

    def _let_finish(self, loser: asyncio.Future[Any], checked: NodeRecord | None = None) -> None:
        """A hedge's losing call runs to its end (bounded by the hop timeout) instead of being cancelled:
        cancelling a grpc.aio call while its read is in flight leaks native memory (grpc/grpc#43360),
        and the loser's real latency is what keeps its hedge delay honest. `checked`: `loser` is the
        deferred check of that node's reply."""
        self._stragglers.add(loser)
        if checked is None:
            loser.add_done_callback(self._straggler_done)
        else:
            loser.add_done_callback(lambda check: self._checked(check, checked))

    def _straggler_done(self, loser: asyncio.Future[_Won | None]) -> None:
        self._stragglers.discard(loser)
        if loser.cancelled():
            return
        if isinstance(loser.exception(), Rewind):  # it failed after an earlier lie: nobody to blame
            return
        if (exc := loser.exception()) is not None:  # _attempt turns call failures into None: this is a bug
            log.error("a hedge's losing call raised", exc_info=exc)
            return
        won = loser.result()
        if won is not None:
            record, _result, latency_ms, screened = won
            self.registry.record_success(record.address, latency_ms)
            if screened is not None and not screened.confirmed:  # its reply was not used: a lie convicts it
                self._let_finish(self._confirm(screened), screened.record)

    def _checked(self, check: asyncio.Future[Lie | None], record: NodeRecord) -> None:
        """A hedge loser's deferred check ended."""
        self._stragglers.discard(check)
        if check.cancelled():
            return
        if (exc := check.exception()) is not None:
            log.error("a hedge loser's check raised", exc_info=exc)
        elif (lie := check.result()) is not None and lie.convict:
            self.registry.quarantine(record.address, str(lie), lie.evidence)

    async def close(self) -> None:
        """Cancel hedge losers still running (the coordinator is stopping)."""
        for task in list(self._stragglers):
            task.cancel()
        await asyncio.gather(*self._stragglers, return_exceptions=True)

    async def _attempt(
        self, record: NodeRecord, x: torch.Tensor, hop: Hop, state: PathState, before: tuple[PendingCheck, ...]
    ) -> _Won | None:
        """One call; a failure goes into the trace and the registry, and gives None. `before`: the
        checks still pending when the hop started: a failure waits for them, and raises Rewind instead
        of blaming this node when one of them lied (this node's input derives from that lie)."""
        started = time.monotonic()
        try:
            result, screened = await self._call(record, x, hop, state, before)
        except HopFailed as exc:
            await self._upstream(before, record, hop, str(exc))
            self._failed(record, hop, state, exc)
            return None
        return record, result, (time.monotonic() - started) * 1e3, screened

    def _failed(self, record: NodeRecord, hop: Hop, state: PathState, exc: HopFailed) -> None:
        state.failed.add(record.address)
        ident = record.identity
        hop.attempts.append(Attempt(record.address, ident.model_id if ident else None, record.block, str(exc)))
        if exc.quarantine:
            self.registry.quarantine(record.address, str(exc), exc.evidence)
        elif exc.blame:
            self.registry.record_failure(record.address, str(exc))

    async def _upstream(self, before: tuple[PendingCheck, ...], record: NodeRecord, hop: Hop, error: str) -> None:
        """Before `record` is blamed for `error`: raise Rewind when a check it depends on failed."""
        culprit = await PendingChecks.first_bad(before)
        if culprit is not None:
            ident = record.identity
            error += f"; not blamed: its input derives from {culprit.record.address}, whose reply failed its check"
            hop.attempts.append(Attempt(record.address, ident.model_id if ident else None, record.block, error))
            raise Rewind(culprit)

    def _alternatives(self, hop: Hop, candidates: list[NodeRecord], state: PathState) -> Iterator[NodeRecord]:
        """Planned candidates first; then (robust families) nodes of spare block indices. Nodes that
        failed earlier in this request are passed over."""
        tried = state.failed
        for record in candidates:
            if record.routable and record.address not in tried:
                yield record
        if state.request.shuffle_robust:
            by_block = self.registry.routable_by_block()
            reserved = state.planned_later | {hop.planned_block}
            for _block, record in substitutes(by_block, state.used, reserved, state.rng, tried):
                if record.routable and record.address not in tried:
                    yield record

    async def _call(
        self, record: NodeRecord, x: torch.Tensor, hop: Hop, state: PathState, before: tuple[PendingCheck, ...]
    ) -> tuple[HopResult, Screened | None]:
        result = await self.hops.forward(record, x, hop.position, state.request, state.route_id, state.path_length)
        if before and (hard := hard_range_problem(result.out, hop.position, result.wire)) is not None:
            await self._upstream(before, record, hop, f"reply out of range: {hard['discrepancy']}")
        return result, await self._verify(record, x, result, hop.position, state)

    def _confirm(self, screened: Screened) -> asyncio.Future[Lie | None]:
        assert self.verifier is not None
        return asyncio.ensure_future(confirmed(self.verifier, screened))

    async def _verify(
        self, record: NodeRecord, x: torch.Tensor, result: HopResult, position: int, state: PathState
    ) -> Screened | None:
        """Blame the node whose reply is wrong, before its output reaches the next (honest) hop; with
        deferred checks only the range filters are done here, and the re-execution still to confirm is
        returned (blocking: the hop confirmed already, `confirmed` set; None: not re-executed)."""
        if self.verifier is None:
            hard = hard_range_problem(result.out, position, result.wire)
            if hard is not None:
                log.warning("quarantining %s: %s", record.address, hard)
                raise HopFailed(f"reply out of range: {hard['discrepancy']}", quarantine=True, evidence=hard)
            return None

        replicas, ask = self._referees(record, x, position, state)
        try:
            screened = self.verifier.screen(
                record,
                x,
                result.out,
                position,
                result.wire,
                force=state.force_verify,
                token_mask=result.token_mask,
                sent=result.sent,
                replicas=replicas,
                ask=ask,
            )
            if screened is None or state.deferred:
                if screened is not None:
                    self.verifier.counters.deferred += 1
                return screened
            await self.verifier.confirm(screened)
            screened.confirmed = True  # checked already (blocking): not again as a decisive hop
            return screened
        except Lie as exc:
            raise HopFailed(str(exc), exc.convict, exc.evidence, exc.convict) from exc

    def _referees(
        self, record: NodeRecord, x: torch.Tensor, position: int, state: PathState
    ) -> tuple[Callable[[], list[NodeRecord]], Ask]:
        """The replicas of `record`'s weights (found only when a hop is re-executed: a scan of every
        node) and how to send them this hop (peer_check.py)."""

        async def ask(peer: NodeRecord) -> torch.Tensor | None:
            """The same hop on a replica (a referee): its reply, or None when it gave none usable."""
            try:
                forward = self.hops.forward(peer, x, position, state.request, state.route_id, state.path_length)
                return (await forward).out  # judged as sent
            except HopFailed as exc:
                log.info("referee %s gave no usable answer: %s", peer.address, exc)
                return None

        def replicas() -> list[NodeRecord]:
            return [
                r for r in same_weights(record, list(self.registry.nodes.values())) if r.address not in state.failed
            ]

        return replicas, ask
