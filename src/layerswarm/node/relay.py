"""Relay chains on the node side: compute this hop, then forward to the next node of the chain.

Events on the Relay stream: first an acknowledgement (this hop computed, with its trace entry), then
one final event: the rest of the chain's trace, and either nothing (the last node kept the result for
the coordinator's Collect), the result inline, or a hand-back: this node's own output and the reason
the next node failed (dead, no acknowledgement within the hop timeout, a refusal). The coordinator
continues from a hand-back under its usual rules (coordinator/relay/chains.py).

What a node forwards is bounded: only along a chain MACed by the coordinator (wire/relay_plan.py),
only to the chain's next step, at most MAX_RELAY_HOPS steps, only its own block output (within its
message limit). Without a swarm token there is no key to check chains with, and Relay is refused.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from layerswarm.wire.auth import derive_key
from layerswarm.wire.relay_plan import (
    MAX_RELAY_HOPS,
    PlanError,
    check_plan,
    digest,
    handback_margin_s,
    rest_wait_s,
)
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.trace_check import entry_problem
from layerswarm.wire.trace_sign import TraceSigner, rest_digest, rest_digests
from layerswarm.wire.v1 import block_pb2 as pb

from .outbox import Outbox, OutboxFull
from .peers import PeerClient, PeerPool, PeerRefused

log = logging.getLogger(__name__)
COLLECT_MAX_WAIT_S = 30.0
MAX_HOP_TIMEOUT_S = 60.0
MAX_DEADLINE_S = 600.0
MAX_REQUEST_ID = 128
ACK_SLACK_MS = 1.0  # two clocks time one compute: ours around it, the next node's inside it
Handle = Callable[[pb.ForwardRequest], Awaitable[pb.ForwardResponse]]


class RelayRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Relayer:
    def __init__(
        self,
        security: SecuritySettings,
        max_message_bytes: int,
        max_hops: int = MAX_RELAY_HOPS,
        streams: bool = True,
        block: int | None = None,
    ) -> None:
        self.key = derive_key(security.token) if security.token else None
        self.block = block  # the block this node serves: a chain step naming another is not ours
        self.max_hops = max_hops
        self.streams = streams  # forward over one long-lived RelayStream per next node (else a call per chain)
        # Under TLS a node forwards only with its relay certificate (its own is serverAuth only).
        self.can_forward = self.key is not None and (not security.tls or security.relay_cert is not None)
        self.peers = PeerPool(security, max_message_bytes) if self.can_forward else None
        self.outbox = Outbox()
        self.signer = TraceSigner()  # this boot's key for its own trace entries (its public half in Info)

    def check(self, request: pb.RelayRequest) -> None:
        if self.key is None:
            raise RelayRefused(grpc.StatusCode.PERMISSION_DENIED, "relay needs a swarm token (--token-file)")
        if not request.HasField("forward"):
            raise RelayRefused(grpc.StatusCode.INVALID_ARGUMENT, "relay request has no forward hop")
        for name, value, limit in (
            ("hop_timeout_s", request.hop_timeout_s, MAX_HOP_TIMEOUT_S),
            ("deadline_s", request.deadline_s, MAX_DEADLINE_S),
        ):
            if not (math.isfinite(value) and 0 < value <= limit):  # a node never waits unbounded on a caller's say
                raise RelayRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{name} {value} outside (0, {limit}]")
        if len(request.forward.request_id) > MAX_REQUEST_ID:
            raise RelayRefused(grpc.StatusCode.INVALID_ARGUMENT, f"request_id longer than {MAX_REQUEST_ID}")
        try:
            check_plan(self.key, request, self.max_hops)
        except PlanError as exc:
            raise RelayRefused(grpc.StatusCode.PERMISSION_DENIED, f"relay chain refused: {exc}") from exc
        problem = self._not_our_step(request.chain[request.index])
        if problem is not None:
            raise RelayRefused(grpc.StatusCode.INVALID_ARGUMENT, f"relay step {request.index} refused: {problem}")
        if not self.can_forward and request.index < len(request.chain) - 1:
            raise RelayRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                "this node has no relay certificate (--tls-relay-cert) to forward a chain under mutual TLS",
            )

    def _not_our_step(self, step: pb.RelayStep) -> str | None:
        """The plan MAC proves the chain is the coordinator's, but not which step the caller says we are
        (`index`): pointed at another node's step, we would run its position and forward past the steps
        between. So the step must name our block and, where it names a trace key, ours."""
        if self.block is not None and step.block != self.block:
            return f"it names block {step.block}; this node serves block {self.block}"
        if step.trace_key and step.trace_key != self.signer.public:
            return "it names another trace key than this node's (another node's, or ours before a restart)"
        return None

    async def relay(self, request: pb.RelayRequest, handle: Handle) -> AsyncIterator[pb.RelayEvent]:
        """Raises RelayRefused (before any event) or the hop's own RequestError; then yields events."""
        started = time.monotonic()
        self.check(request)
        if request.collect and request.index == len(request.chain) - 1:
            try:  # before computing: a node of the chain racing our step gets a few runs, no more (outbox.py)
                self.outbox.reserve(request.forward.request_id)
            except OutboxFull as exc:
                raise RelayRefused(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from exc
        # Digests are hashed off the loop, beside work that has to happen anyway: the input's while
        # the block computes, the output's while it is on its way to the next node.
        received = asyncio.ensure_future(asyncio.to_thread(digest, request.forward.activations.data))
        try:
            reply = await handle(request.forward)
        finally:
            input_sha256 = await received
        step = request.chain[request.index]
        own = pb.HopTrace(
            node=step.address,
            block=step.block,
            position=step.position,
            compute_ms=reply.compute_ms,
            input_sha256=input_sha256,
            given_deadline_s=request.deadline_s,  # signed: what we were given, for the coordinator to check
            given_hop_timeout_s=request.hop_timeout_s,
        )
        rid = request.forward.request_id
        if request.index == len(request.chain) - 1:
            own.output_sha256 = digest(reply.activations.data)
            own.rest_sha256 = rest_digest((), rid, request.plan_mac)
            self.signer.sign(own, rid, request.plan_mac)  # the final event copies it: sign it first
            if request.collect:
                self.outbox.put(rid, reply)  # before the acknowledgement: the coordinator is waiting on it
            yield pb.RelayEvent(request_id=rid, ack=True, trace=[own])
            activations = None if request.collect else reply.activations
            yield pb.RelayEvent(request_id=rid, trace=[own], activations=activations)
            return
        # Our final event must reach our caller within the deadline it gave (when it stops waiting), a
        # hand-back included: we stop waiting for the rest of the chain a margin before that.
        left_s = request.deadline_s - (time.monotonic() - started) - handback_margin_s(request.deadline_s)
        # Acknowledge, then forward: the ack is a few bytes, and sent after our output it would queue
        # behind 302 KB on this host's uplink, so the previous node's send_ms (its link estimate)
        # would count our transfer too. The output's digest is in the final event, not the ack.
        yield pb.RelayEvent(request_id=rid, ack=True, trace=[own])
        output_sha256 = asyncio.ensure_future(asyncio.to_thread(digest, reply.activations.data))
        onward = asyncio.ensure_future(self._forward(request, reply, own, left_s, output_sha256))
        try:
            own.output_sha256 = await output_sha256
            final = await onward
        finally:
            if not onward.done():
                onward.cancel()
        entry = final.trace[0]  # its rest_sha256 (what we vouch for) set by _forward
        entry.output_sha256 = own.output_sha256  # a fast hand-back may have copied `own` before
        self.signer.sign(entry, rid, request.plan_mac)
        yield final

    async def _forward(
        self,
        request: pb.RelayRequest,
        reply: pb.ForwardResponse,
        own: pb.HopTrace,
        left_s: float,
        output_sha256: asyncio.Future[str],
    ) -> pb.RelayEvent:
        """Send our output on; whatever goes wrong, hand our output back with the reason. The rest of
        the chain's trace is passed on only once the next node's entry checks out (wire/trace_check.py):
        what we pass on, we answer for."""
        assert self.peers is not None
        nxt = request.chain[request.index + 1]
        rid = request.forward.request_id
        onward = pb.RelayRequest(
            forward=pb.ForwardRequest(
                request_id=rid,
                activations=reply.activations,
                position=nxt.position,
                path_length=request.forward.path_length,
                reply_dtype=request.forward.reply_dtype,
            ),
            chain=request.chain,
            index=request.index + 1,
            plan_mac=request.plan_mac,
            issued_ms=request.issued_ms,
            hop_timeout_s=request.hop_timeout_s,
            # When we stop waiting: the next node stops a margin before it, so its hand-back still reaches us.
            deadline_s=max(left_s, 0.001),
            collect=request.collect,
        )

        def hand_back(reason: str) -> pb.RelayEvent:
            log.info("relay %s: handing back after step %d: %s", rid, request.index, reason)
            own.rest_sha256 = rest_digest((), rid, request.plan_mac)  # we pass nothing back but our own
            where = f"step {request.index + 1} ({nxt.address}, block {nxt.block})"
            return pb.RelayEvent(
                request_id=rid, trace=[own], activations=reply.activations, handback_reason=f"{where}: {reason}"
            )

        if left_s <= 0:
            return hand_back("DEADLINE_EXCEEDED: no time left for the rest of the chain")
        deadline = time.monotonic() + left_s
        call: Any = None
        peer: PeerClient | None = None
        try:
            peer = await self.peers.get(nxt.address)
            await peer.prove(nxt.block, min(request.hop_timeout_s, left_s))
            sent = time.monotonic()
            call = await peer.relay(onward, left_s, stream=self.streams)
            ack = await _read(call, min(request.hop_timeout_s, deadline - time.monotonic()))
            if ack is None:
                return hand_back("DEADLINE_EXCEEDED: no acknowledgement within the hop timeout")
            if ack is grpc.aio.EOF or not ack.ack or len(ack.trace) != 1:
                call.cancel()
                return hand_back("no acknowledgement from the next node")
            waited_ms = (time.monotonic() - sent) * 1e3
            problem = ack_problem(ack.trace[0], waited_ms)
            if problem is not None:
                return hand_back(problem)
            send_ms = waited_ms - ack.trace[0].compute_ms
            own.send_ms, own.sent_bytes = send_ms, len(onward.forward.activations.data)
            self.peers.observe(nxt.address, own.sent_bytes, send_ms)
            self.peers.probe_soon(peer)
            own.rtt_ms = self.peers.rtt_ms(nxt.address)
            rest_s = rest_wait_s(len(request.chain) - request.index - 2, request.hop_timeout_s)
            final = await _read(call, min(deadline - time.monotonic(), rest_s))
            if final is None:
                return hand_back(
                    f"DEADLINE_EXCEEDED: the rest of the chain did not finish within its deadline or {rest_s:.3g} s "
                    "of the acknowledgement (its hop timeouts)"
                )
        except grpc.aio.AioRpcError as exc:
            if peer is not None:
                peer.refused(exc)
            return hand_back(f"{exc.code().name}: {exc.details()}")
        except PeerRefused as exc:
            return hand_back(f"PERMISSION_DENIED: {exc}")
        finally:
            if call is not None:  # done with it however it went (a no-op once it ended)
                call.cancel()
        if final is grpc.aio.EOF:
            return hand_back("the next node closed the chain without a result")
        problem = final_problem(final, request.chain, request.index + 1)
        if problem is not None:
            return hand_back(problem)
        rests = rest_digests(final.trace, rid, request.plan_mac)  # [0]: what we vouch for; [1]: what nxt did
        entry_wrong = entry_problem(final.trace[0], nxt, rests[1], await output_sha256, rid, request.plan_mac)
        if entry_wrong is not None:
            return hand_back(f"its trace entry cannot be believed: {entry_wrong}")
        own.rest_sha256 = rests[0]
        return pb.RelayEvent(
            request_id=rid,
            trace=[own, *final.trace],
            activations=final.activations if final.HasField("activations") else None,
            handback_reason=final.handback_reason,
        )

    async def collect(self, request: pb.CollectRequest, time_left: float | None) -> pb.ForwardResponse | None:
        if len(request.request_id) > MAX_REQUEST_ID:
            return None
        wait = COLLECT_MAX_WAIT_S if time_left is None else min(time_left, COLLECT_MAX_WAIT_S)
        return await self.outbox.take(request.request_id, wait, request.output_sha256)

    async def close(self) -> None:
        if self.peers is not None:
            await self.peers.close()


def ack_problem(entry: pb.HopTrace, waited_ms: float) -> str | None:
    """Why the next node's acknowledgement cannot be believed, or None. Its compute happened while we
    waited for it, so it cannot be longer than our wait: we take it off our wait to measure the link,
    sign the result as our own forwarding time, and the coordinator voids a chain over impossible times
    blaming the nodes at that entry. A next node lying here must be blamed itself, never us."""
    compute_ms = entry.compute_ms
    if not (math.isfinite(compute_ms) and 0 <= compute_ms <= waited_ms + ACK_SLACK_MS):
        return f"implausible acknowledgement: compute_ms {compute_ms:.6g} over a wait of {waited_ms:.3f} ms"
    return None


def final_problem(final: pb.RelayEvent, chain: Sequence[pb.RelayStep], index: int) -> str | None:
    """Why the final event of the step at `index` is not one of this chain, or None: it carries that
    step's entry and those after it, all of them unless it hands back. Passed on as it is, a shortened
    trace with no hand-back would leave the coordinator waiting on a result the last node never got,
    and then blaming the last node; checked here, the node that sent it is the one handed back."""
    rest, entries = len(chain) - index, len(final.trace)
    if final.ack or not 1 <= entries <= rest or (entries < rest and not final.handback_reason):
        what = "a hand-back" if final.handback_reason else "no hand-back"
        return f"malformed final event: {entries} trace entries for the {rest} steps left, with {what}"
    first, step = final.trace[0], chain[index]
    if (first.node, first.block, first.position) != (step.address, step.block, step.position):
        return "malformed final event: its first trace entry is not the next step's"
    return None


async def _read(call: Any, timeout: float) -> Any:
    """The next event of a Relay call or a RelayStream request (EOF: the call ended); None, and the call
    cancelled, when none came within `timeout`."""
    try:
        return await asyncio.wait_for(call.read(), max(timeout, 0.001))
    except asyncio.TimeoutError:  # not the builtin before Python 3.11 (Jetson images run 3.10)
        call.cancel()
        return None
