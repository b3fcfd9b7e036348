"""Relay hand-backs checked by the coordinator itself (docs/relay.md, "Blame").

A node that hands back says the next node of its chain failed. Nothing proves it: a timeout or a
refusal leaves no trace the coordinator could check, and a hostile node could say it on every chain to
get an honest node ejected. So the named node's failure is never recorded on that word. The request
just goes around it; meanwhile the coordinator tries the claim itself, in the background: it forwards
the handed-back activation (the named node's input) to the named node by a star call, within the hop
timeout. A failure or no answer in time is what the coordinator saw itself and counts against the named
node as a failed star hop would (that is how a dead or too slow node is still ejected); an answer in
time contradicts the claim. How it went is counted for the node that made the claim (membership/claims.py), which
is where repeated false claims have a consequence. What the probe cannot see: a node that serves star
calls but fails chains (a relay-only staller); claims against it read as contradicted, and the claimer
ending chains only (membership/claims.py) stops the disputed forward from recurring either way.

A claim also counts only if its claimer was given honest limits: the deadline and hop timeout it
waited under reach it from the node before it, which could shorten them so that an honest node times
out on its honest successor, again and again, until it may only end chains. The claimer signs what it
was given into its trace entry, and `given_times_problem` holds that against the coordinator's own
clock, for every entry of the trace (a shortened limit is passed on, shrinking, to every node after
it): a claim made after limits were shortened is `discounted`, not probed, the named node only left
out of that request. The first entry whose limits are impossible shows that it or the node before it
lied: that pair is disputed (membership/claims.py: never adjacent for a while, nobody's standing changed), or,
for the chain's first node, which had its limits from the coordinator itself, the lie is its own and
counts as a contradicted claim. A hand-back because the named node had already run the step (another
node of the chain raced it there, node/outbox.py) is disputed between the claimer and the named node
the same way.

One probe per named node at a time: claims against a node already being probed wait for that probe's
outcome. At most `max_probes` at once: past that a claim is counted `unchecked` and left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from layerswarm.wire import codec
from layerswarm.wire.relay_plan import HANDBACK_MARGIN_S
from layerswarm.wire.v1 import block_pb2 as pb

from ..membership.clients import ClientPool
from ..membership.registry import Registry
from ..verification.ranges import hard_range_problem

log = logging.getLogger(__name__)
MAX_PROBES = 32  # probes in flight at once (each is one block's forward on the named node)
CONFIRMED, CONTRADICTED, UNCHECKED, DISCOUNTED = "confirmed", "contradicted", "unchecked", "discounted"
GIVEN_SLACK_S = 0.005  # float and timer rounding in the deadline check below

# (named node, the handed-back activation as its Forward) -> answered in time, or None (not known)
Probe = Callable[[str, pb.ForwardRequest], Awaitable[bool | None]]


def forward_probe(registry: Registry, pool: ClientPool, hop_timeout_s: float) -> Probe:
    """The claim tried: the named node's own input, forwarded to it by the coordinator within the hop
    timeout. Its failure is recorded as a failed star hop's is (the coordinator saw it itself)."""

    async def probe(address: str, request: pb.ForwardRequest) -> bool | None:
        if address not in registry.nodes:
            return None
        try:
            reply = await pool.get(address).forward(request, hop_timeout_s)
        except grpc.aio.AioRpcError as exc:
            registry.record_failure(address, f"forward after a hand-back: {exc.code().name}: {exc.details()}")
            return False
        except asyncio.TimeoutError:  # Python 3.10: asyncio's own class, not the builtin (one class from 3.11 on)
            registry.record_failure(address, f"forward after a hand-back: no answer within {hop_timeout_s} s")
            return False
        problem = malformed(request, reply)
        if problem is not None:  # as a star hop's malformed reply is: provably wrong, whoever asked
            registry.quarantine(address, f"forward after a hand-back: malformed activations ({problem})")
            return False
        return True

    return probe


def given_times_problem(entry: pb.HopTrace, sent: pb.RelayRequest, step: int, waited_s: float) -> str | None:
    """Why the node of chain step `step` (its signed `entry`) cannot have been given limits as long as
    this chain passes on, or None. `sent`: the chain's request as the coordinator sent it; `waited_s`:
    from sending it to the hand-back's arrival, on the coordinator's clock. Only shorter limits count
    (a longer one makes no honest node time out early); NaN never passes.

    Every node passes on the hop timeout unchanged, and as deadline what was left of its own less a
    margin (node/relay.py, wire/relay_plan.handback_margin_s). So the deadline that reached step k,
    added to when it arrived, ends no earlier than ours less k margins; and it arrived before its
    node's hand-back reached us."""
    if not entry.given_hop_timeout_s >= sent.hop_timeout_s:
        given, chain = entry.given_hop_timeout_s, sent.hop_timeout_s
        return f"it was given a hop timeout of {given!r} s, the chain's is {chain!r} s"
    least = sent.deadline_s - step * HANDBACK_MARGIN_S - waited_s
    if not entry.given_deadline_s >= least - GIVEN_SLACK_S:
        return f"it was given {entry.given_deadline_s:.6g} s for the rest of the chain, at least {least:.6g} s was left"
    return None


def first_shortened(trace: list[pb.HopTrace], sent: pb.RelayRequest, waited_s: float) -> tuple[int, str] | None:
    """The first step of the trace given limits shorter than the chain's (every step after it got
    what was left of them), and why; None when every step's limits are possible."""
    for step, entry in enumerate(trace):
        problem = given_times_problem(entry, sent, step, waited_s)
        if problem is not None:
            return step, problem
    return None


def malformed(request: pb.ForwardRequest, reply: pb.ForwardResponse) -> str | None:
    """Why a block's reply cannot be its output for this input (relay chains are image-only: a block
    keeps its input's shape), or None. An answer in time contradicts a claim only if it is an answer."""
    try:
        out = codec.decode(reply.activations)
    except codec.TensorError as exc:
        return str(exc)
    if tuple(out.shape) != tuple(request.activations.shape):
        return f"reply shape {tuple(out.shape)} differs from the input's {tuple(request.activations.shape)}"
    wire = codec.torch_dtype(reply.activations.dtype)
    hard = hard_range_problem(out, request.position, wire)  # NaN and Inf included, as on every star reply
    return None if hard is None else f"{hard['discrepancy']}, past {hard['against']}"


class HandbackReferee:
    def __init__(
        self,
        registry: Registry,
        probe: Probe,
        timeout_s: float,
        on_outcome: Callable[[str], None] | None = None,
        max_probes: int = MAX_PROBES,
    ) -> None:
        self.registry = registry
        self.probe = probe
        self.timeout_s = timeout_s
        self.on_outcome = on_outcome
        self.max_probes = max_probes
        self._claimers: dict[str, set[str]] = {}  # named node -> nodes that named it, while it is probed
        self._tasks: set[asyncio.Task[None]] = set()  # held, or a running probe could be garbage-collected
        self._closed = False  # the coordinator is stopping: no new probes (their channels are closing)

    @property
    def probing(self) -> frozenset[str]:
        return frozenset(self._claimers)

    def claim(self, claimer: str, named: str, retry: pb.ForwardRequest) -> None:
        """`claimer` handed back naming `named` as failed: probe `named` ourselves, without waiting,
        with `retry` (the handed-back activation as `named`'s Forward)."""
        if named in self._claimers:
            self._claimers[named].add(claimer)
            return
        if self._closed or len(self._claimers) >= self.max_probes or named not in self.registry.nodes:
            log.info("hand-back by %s naming %s unchecked (%d probes running)", claimer, named, len(self._claimers))
            self._count(UNCHECKED)
            return
        self._claimers[named] = {claimer}
        task = asyncio.create_task(self._probe(named, retry), name=f"hand-back probe {named}")
        self._tasks.add(task)
        task.add_done_callback(self._probed)

    def handed_back(
        self,
        steps: list[str],
        trace: list[pb.HopTrace],
        sent: pb.RelayRequest,
        retry: pb.ForwardRequest,
        waited_s: float,
        reason: str,
    ) -> str | None:
        """A chain handed back for `reason`: `steps`, its addresses up to the named node (the claimer is
        `steps[-2]`), `trace` its checked entries, `sent` the chain's request, `retry` the named node's
        input, `waited_s` until the hand-back came. Probes the claim, or says why not (returned): limits
        were shortened on the way, or the named node refused because it had already run the step."""
        claimer, named = steps[-2], steps[-1]
        shortened = first_shortened(trace, sent, waited_s)
        if shortened is not None:
            step, problem = shortened
            why = f"step {step} ({steps[step]}): {problem}"
            self.discount(claimer, named, (steps[step - 1] if step else None, steps[step]), why)
            return why
        if ": ALREADY_EXISTS:" in reason:
            why = f"{named} had already run the step for this request: a node of the chain raced it there"
            self.discount(claimer, named, (claimer, named), why)
            return why
        self.claim(claimer, named, retry)
        return None

    def discount(self, claimer: str, named: str, liar: tuple[str | None, str], why: str) -> None:
        """A claim not to be probed, since one of the two nodes `liar` (adjacent: the first may be None,
        the coordinator) lied: a pair disputed, or where the coordinator itself is the first, the
        second's lie, counted as a contradicted claim."""
        log.warning("hand-back by %s naming %s discounted: %s", claimer, named, why)
        self._count(DISCOUNTED)
        before, after = liar
        if before is not None:
            self.registry.claims.disputed(before, after)
        elif self.registry.claims.contradicted(after):
            log.warning("node %s: hand-backs in a row it could not back: it only ends relay chains for a while", after)

    async def wait(self) -> None:
        """Until the probes running now have ended (for tests and shutdown)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await self.wait()

    async def _probe(self, named: str, retry: pb.ForwardRequest) -> None:
        answered: bool | None = None
        try:
            answered = await self._answered(named, retry)
        finally:  # however it ended, the claims it gathered are settled and the next claim probes anew
            self._judge(self._claimers.pop(named, set()), named, answered)

    async def _answered(self, named: str, retry: pb.ForwardRequest) -> bool | None:
        """The probe, bounded here too (a backstop: the forward has its own deadline): no answer in
        time is a failure of `named`."""
        try:
            return await asyncio.wait_for(self.probe(named, retry), self.timeout_s)
        except asyncio.TimeoutError:  # Python 3.10: asyncio's own class, not the builtin (one class from 3.11 on)
            self.registry.record_failure(named, f"forward after a hand-back: no answer within {self.timeout_s} s")
            return False

    def _judge(self, claimers: set[str], named: str, answered: bool | None) -> None:
        for claimer in claimers:
            if answered is None:
                self._count(UNCHECKED)
            elif not answered:
                self.registry.claims.confirmed(claimer)
                self._count(CONFIRMED)
            else:
                self._contradicted(claimer, named)

    def _contradicted(self, claimer: str, named: str) -> None:
        log.info("hand-back by %s contradicted: %s answered the coordinator's forward in time", claimer, named)
        self._count(CONTRADICTED)
        if self.registry.claims.contradicted(claimer):
            log.warning(
                "node %s: %d hand-backs in a row named nodes that answer: it only ends relay chains for %.0f s",
                claimer,
                self.registry.claims.strikes,
                self.registry.claims.bar_s,
            )

    def _count(self, outcome: str) -> None:
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def _probed(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())
