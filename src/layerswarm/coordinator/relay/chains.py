"""Relay chains on the coordinator side (docs/relay.md): nodes forward activations to each other.

The path is cut into chains of consecutive hops. A chain goes to its first node with the whole chain
MACed (wire/relay_plan.py); each node forwards its output to the next; the last keeps the result,
which the coordinator collects from it directly (a Collect call opened when the chain starts), while
the trace (compute and send times, digests of every hop's input and output) comes back along the
chain. When a node fails, the node before it hands back its own output with the reason, and the
coordinator continues from there with star hops (substitutes, verification: routing/executor.py), then chains
again. A hand-back is a claim, not evidence: the node it names is only avoided for the request, and
probed by the coordinator itself before any failure counts against it (handbacks.py).

Trust: a hop the verifier wants to check (probation, sampled) runs star, where the coordinator sees
its input and output; chains are cut around it. For relayed hops the coordinator checks the digest
chain (each hop's input digest is the previous hop's output digest, the first is what we sent, the
last is what we collected), each entry's signature and the entries its node vouched for, and the
result's range (wire/trace_check.py); a break throws the chain's result away, marks the node to blame
as failed and goes on star from the last activation the coordinator held. A node that gives no
trace key is never chained (its entries could not be checked): its steps run star.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from dataclasses import dataclass, field

import grpc
import torch

from layerswarm.wire import codec
from layerswarm.wire.relay_plan import digest, plan_mac, rest_wait_s
from layerswarm.wire.v1 import block_pb2 as pb

from ..membership.clients import ClientPool
from ..membership.linkmap import COORDINATOR
from ..membership.records import NodeRecord
from ..membership.registry import Registry
from ..routing.executor import PathExecutor, Resume
from ..routing.planner import Plan, Step
from ..routing.request import Request
from ..routing.trace import ChainEnd, DepthError, Hop, PathResult
from ..routing.wire_choice import WireFormat
from ..verification.ranges import hard_range_problem
from ..verification.verifier import Verifier
from .chain_trace import Broken, observe_relay_link, trace_problem
from .handbacks import HandbackReferee

log = logging.getLogger(__name__)


@dataclass
class ChainResult:
    x: torch.Tensor  # the activations to continue from (the chain's result, or the hand-back)
    hops: list[Hop]  # the hops the coordinator accepts as run
    handback: ChainEnd | None = None  # why the chain stopped early


@dataclass
class _Run:
    """One route's relay run: what ran, what failed, where we are."""

    x: torch.Tensor
    request: Request
    route_id: str  # the request id the nodes see
    hops: list[Hop] = field(default_factory=list)
    handbacks: list[ChainEnd] = field(default_factory=list)
    avoid: set[str] = field(default_factory=set)  # nodes that failed in this request
    chains: int = 0
    wire: torch.dtype | None = None  # the current chain's wire dtype (--wire-dtype auto: per chain)
    sampled: dict[tuple[int, str], bool] = field(default_factory=dict)  # (step, node) -> verifier wants it

    @property
    def depth(self) -> int:
        return sum(1 for h in self.hops if h.block is not None)

    @property
    def used(self) -> frozenset[int]:
        return frozenset(h.block for h in self.hops if h.block is not None)


class RelayRunner:
    def __init__(
        self,
        registry: Registry,
        pool: ClientPool,
        executor: PathExecutor,
        key: bytes,
        wire: WireFormat,
        hop_timeout_s: float,
        verifier: Verifier | None = None,
        referee: HandbackReferee | None = None,  # None: hand-backs are only routed around, never checked
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.executor = executor
        self.key = key
        self.wire = wire
        self.hop_timeout_s = hop_timeout_s  # every node of a chain holds the next one to it
        self.verifier = verifier
        self.referee = referee

    async def run(self, x: torch.Tensor, plan: Plan, request: Request, route_id: str, rng: random.Random) -> PathResult:
        """The plan as relay chains where nodes may be chained, star steps elsewhere (no per-hop exit
        inside a chain). Raises DepthError when fewer than the request's minimum depth ran."""
        run = _Run(x, request, route_id)
        steps = list(plan.steps)
        i = 0
        while i < len(steps) and time.monotonic() < request.deadline:
            segment = self._segment(steps, i, run)
            if len(segment) >= 2:
                result = await self._chain(run, segment, len(steps))
                run.x = result.x
                run.hops.extend(result.hops)
                i += len(result.hops)
                if result.handback is not None:
                    run.handbacks.append(result.handback)
                    if not result.hops:  # the first node itself failed: that step goes star
                        i = await self._star(run, steps, i, len(steps), rng, force=False)
                continue
            i = await self._star(run, steps, i, len(steps), rng, force=self._wants_check(steps, i, run))
        path = PathResult(
            run.x, run.hops, plan.unreachable, topology="relay", handbacks=run.handbacks, chains=run.chains
        )
        if path.depth < request.min_blocks:
            raise DepthError(f"only {path.depth} blocks could run (minimum {request.min_blocks}) in relay mode")
        return path

    def _pick(self, step: Step, run: _Run) -> NodeRecord | None:
        return next((r for r in step.candidates if r.routable and r.address not in run.avoid), None)

    def _segment(self, steps: list[Step], start: int, run: _Run) -> list[tuple[Step, NodeRecord]]:
        """The longest run of steps from `start` whose chosen nodes may be relayed through: routable,
        not failed in this request, with a trace key, not wanted by the verifier (those run star), and
        ending at the first node whose hand-backs keep being contradicted (membership/claims.py: it may end a
        chain, never forward). Fewer than two: step `start` runs star.

        A node without a trace key (its Info gave none) never joins a chain: unsigned entries would let
        an earlier node cut the trace short and hand back in a later node's name, and since a node
        chooses what its own Info says, a hostile one could leave its key out to get exactly that."""
        segment: list[tuple[Step, NodeRecord]] = []
        for index, step in enumerate(steps[start:], start):
            record = self._pick(step, run)
            if record is None or not _trace_key(record) or step.block in run.used or self._sampled(run, index, record):
                break
            if segment and not self.registry.claims.may_follow(segment[-1][1].address, record.address):
                break  # a disputed pair (membership/claims.py): the chain ends before it
            segment.append((step, record))
            if not self.registry.claims.may_forward(record.address):
                break
        return segment

    def _wants_check(self, steps: list[Step], i: int, run: _Run) -> bool:
        """Whether step i, running star, runs star because the verifier drew it (then it is re-executed)."""
        record = self._pick(steps[i], run)
        return record is not None and self._sampled(run, i, record)

    def _sampled(self, run: _Run, index: int, record: NodeRecord) -> bool:
        """Whether the verifier wants step `index` on `record` checked: drawn once per request. A step
        that ends a chain because it was sampled is where the next segment starts, and a second draw
        there (1 - rate: almost always no) would relay it unchecked: the configured share of hops
        would never be re-executed, only the few sampled at a segment's first step."""
        if self.verifier is None:
            return False
        key = (index, record.address)
        if key not in run.sampled:
            run.sampled[key] = self.verifier.wants(record)
        return run.sampled[key]

    async def _star(self, run: _Run, steps: list[Step], i: int, length: int, rng: random.Random, force: bool) -> int:
        """Step i as a star hop, with the executor's substitutes, deadlines and verification."""
        step = steps[i]
        later, avoid = frozenset(s.block for s in steps[i + 1 :]), frozenset(run.avoid)
        force_verify = force and self.verifier is not None
        resume = Resume(run.depth, run.used, length, force_verify=force_verify, later=later, avoid=avoid)
        plan = Plan([Step(step.block, step.candidates, step.repeat)], [])  # avoid: Resume's
        sub = await self.executor.run(run.x, plan, run.request, run.route_id, rng, resume=resume)
        run.x = sub.activations
        run.hops.extend(sub.hops)
        for attempt in (a for h in sub.hops for a in h.attempts):
            run.avoid.add(attempt.node)
        return i + 1

    async def _chain(self, run: _Run, segment: list[tuple[Step, NodeRecord]], length: int) -> ChainResult:
        first_position = run.depth
        chain = [
            pb.RelayStep(address=r.address, position=first_position + k, block=r.block, trace_key=_trace_key(r))
            for k, (_, r) in enumerate(segment)
        ]
        run.chains += 1
        rid = f"{run.route_id}-c{run.chains}"
        issued = int(time.time() * 1000)
        run.wire = self._chain_wire(run, chain)
        activations = codec.encode(run.x, run.wire)
        left = max(0.001, run.request.deadline - time.monotonic())
        request = pb.RelayRequest(
            forward=pb.ForwardRequest(
                request_id=rid, activations=activations, position=first_position, path_length=length
            ),
            chain=chain,
            index=0,
            plan_mac=plan_mac(self.key, rid, issued, chain, collect=True),
            issued_ms=issued,
            hop_timeout_s=self.hop_timeout_s,
            deadline_s=left,
            collect=True,
        )
        started = time.monotonic()
        collect = asyncio.ensure_future(self.pool.get(chain[-1].address).collect(rid, left))
        try:
            rest_s = rest_wait_s(len(chain) - 1, self.hop_timeout_s)
            events = await self.pool.get(chain[0].address).relay(request, left, self.hop_timeout_s, rest_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:  # 3.10: asyncio's own TimeoutError
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
            reason = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
            return self._failed_start(run, segment[0][1], reason)
        waited_s = time.monotonic() - started  # until the final event: a hand-back's claimer got its limits before
        result = await self._accept(run, segment, events, request, collect, waited_s)
        if self.wire.choice is not None:  # --wire-dtype auto: the trace says what the chain was sent in
            for hop in result.hops:
                hop.wire = codec.dtype_name(run.wire)
        if result.handback is None and len(result.hops) == len(segment):
            self._observe_ends(chain, result.hops, (time.monotonic() - started) * 1e3, len(activations.data))
        return result

    def _chain_wire(self, run: _Run, chain: list[pb.RelayStep]) -> torch.dtype:
        """The request's wire dtype, or with --wire-dtype auto the one the chain's links pay for."""
        if self.wire.choice is None:
            return self.wire.dtype
        ends = [COORDINATOR, *(step.address for step in chain), COORDINATOR]
        measured = [self.registry.links.per_mb(a, b) for a, b in itertools.pairwise(ends)]
        return self.wire.choice.choose(measured, run.x.numel())

    def _observe_ends(self, chain: list[pb.RelayStep], hops: list[Hop], elapsed_ms: float, nbytes: int) -> None:
        """A whole chain measures its two coordinator legs together: its time less every hop's compute
        and forwarding, half each way (passive: the request's own traffic)."""
        legs = max(elapsed_ms - sum(h.latency_ms for h in hops), 0.0) / 2
        self.registry.links.observe(COORDINATOR, chain[0].address, nbytes, legs)
        self.registry.links.observe(chain[-1].address, COORDINATOR, nbytes, legs)

    def _failed_start(self, run: _Run, record: NodeRecord, reason: str) -> ChainResult:
        self.registry.record_failure(record.address, reason)
        run.avoid.add(record.address)
        reason = f"step 0 ({record.address}): {reason}"
        return ChainResult(run.x, [], {"kind": "not_started", "after_step": -1, "reason": reason})

    async def _accept(
        self,
        run: _Run,
        segment: list[tuple[Step, NodeRecord]],
        events: list[pb.RelayEvent],
        request: pb.RelayRequest,
        collect: asyncio.Future[pb.ForwardResponse],
        waited_s: float,
    ) -> ChainResult:
        """Check the chain's trace and result; give the hops and activations to continue from."""
        final = events[-1] if events else None
        trace = list(final.trace) if final is not None else []
        handed_back = final is not None and bool(final.handback_reason)
        broken = trace_problem(trace, segment, request, handed_back)
        result: pb.Tensor | None = None
        if broken is None and handed_back:
            result = final.activations if final is not None else None
        elif broken is None:
            result = await _collected(collect, self.hop_timeout_s)
            if not collect.done():  # no answer at all: asking the silent last node again costs another hop timeout
                last = len(trace) - 1
                broken = Broken(
                    last, "the last node's result did not come within a hop timeout of its final event", last
                )
        if not collect.done():
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
        if broken is None and not handed_back and (result is None or digest(result.data) != trace[-1].output_sha256):
            result = await self._collect_signed(segment[-1][1], request, trace[-1].output_sha256)
            if result is None:  # the last node signed its output's digest and cannot serve it: it alone
                last = len(trace) - 1
                broken = Broken(last, "the last node serves no result with the digest it signed", last)
        x = self._decode(result, run) if broken is None and result is not None else None
        if x is None:
            return self._discard(run, segment, broken or Broken(len(trace) - 1, "malformed result"))
        hops = [self._hop(t, step, record) for t, (step, record) in zip(trace, segment, strict=False)]
        for sender, receiver in itertools.pairwise(trace):  # node -> node links, measured by the sender
            observe_relay_link(self.registry.links, sender, receiver)
        handback: ChainEnd | None = None
        if final is not None and final.handback_reason:
            after_step = run.depth + len(trace) - 1
            handback = {"kind": "handed_back", "after_step": after_step, "reason": final.handback_reason}
            if len(trace) < len(segment) and result is not None:
                if ": ALREADY_EXISTS:" not in final.handback_reason:  # a duplicate refused: no failure
                    run.avoid.add(segment[len(trace)][1].address)  # a claim: only left out of this request
                retry = pb.ForwardRequest(  # the named node's input: what the claimer says it could not pass on
                    request_id=f"{request.forward.request_id}-probe",
                    activations=result,
                    position=request.chain[len(trace)].position,
                    path_length=request.forward.path_length,
                )
                steps = [r.address for _, r in segment[: len(trace) + 1]]
                if self.referee is not None:  # it probes the claim, or says why it will not
                    discounted = self.referee.handed_back(steps, trace, request, retry, waited_s, final.handback_reason)
                    if discounted:
                        handback["discounted"] = discounted
        return ChainResult(x, hops, handback)

    async def _collect_signed(self, last: NodeRecord, request: pb.RelayRequest, sha256: str) -> pb.Tensor | None:
        """The result the last node signed, when the Collect opened with the chain gave another run of
        its step (any node of the chain could have run it first) or none (Collects for made-up request
        ids can fill the node's waiting places: node/outbox.py)."""
        rid = request.forward.request_id
        log.warning("relay %s: %s served no result or another; collecting the one it signed", rid, last.address)
        try:
            reply = await self.pool.get(last.address).collect(rid, request.hop_timeout_s, sha256)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError):  # 3.10: asyncio's own TimeoutError
            return None
        return reply.activations if digest(reply.activations.data) == sha256 else None

    def _decode(self, tensor: pb.Tensor, run: _Run) -> torch.Tensor | None:
        try:
            out = codec.decode(tensor, self.wire.spec)
        except codec.TensorError as exc:
            log.warning("relay result malformed: %s", exc)
            return None
        wire = run.wire or self.wire.dtype
        if out.shape != run.x.shape or hard_range_problem(out, run.depth, wire) is not None:
            return None
        return out.to(torch.float32)

    def _hop(self, t: pb.HopTrace, step: Step, record: NodeRecord) -> Hop:
        self.registry.record_success(record.address, t.compute_ms)
        ident = record.identity
        return Hop(
            position=t.position,
            planned_block=step.block,
            block=t.block,
            node=t.node,
            model_id=ident.model_id if ident else None,
            latency_ms=t.compute_ms + max(t.send_ms, 0.0),
            outcome="relayed",
            repeat=step.repeat,
            send_ms=round(t.send_ms, 3) if t.send_ms else None,
        )

    def _discard(self, run: _Run, segment: list[tuple[Step, NodeRecord]], broken: Broken) -> ChainResult:
        """The chain's result cannot be trusted: none of its hops count; the node to blame fails, or
        where the trace cannot say which (nodes without trace keys), both nodes at the break."""
        log.warning("relay chain %s discarded: %s", [r.address for _, r in segment], broken.reason)
        at = min(max(broken.step, 0), len(segment) - 1)
        blamed = [segment[broken.only]] if broken.only is not None else segment[max(0, at - 1) : at + 1]
        for _, record in blamed:
            self.registry.record_failure(record.address, f"relay chain discarded: {broken.reason}")
            run.avoid.add(record.address)
        reason = f"chain discarded: {broken.reason}"
        return ChainResult(run.x, [], {"kind": "discarded", "after_step": -1, "reason": reason})


def _trace_key(record: NodeRecord) -> bytes:
    return record.identity.trace_key if record.identity is not None else b""


async def _collected(collect: asyncio.Future[pb.ForwardResponse], timeout_s: float) -> pb.Tensor | None:
    """The Collect opened with the chain: its result, or None (logged) when it failed or has not come
    within `timeout_s` of the chain's final event. The last node puts its result out before it even
    acknowledges, so by the final event the result is on its way: one that has not come within a hop
    timeout is not coming (the last node went silent), and waiting on it to the request's deadline
    would leave no time to run the chain's steps again."""
    done, _ = await asyncio.wait({collect}, timeout=timeout_s)
    if not done:
        log.info("relay collect: no result within %.3g s of the chain's final event", timeout_s)
        return None
    try:
        return collect.result().activations
    except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:  # 3.10: asyncio's own TimeoutError
        log.info("relay collect failed: %s", exc)
        return None
