"""Deferred verification's edge paths (coordinator/deferred.py, executor.py) on real in-process nodes: a
hedge loser that lied is convicted without rewinding the request it lost in; past MAX_REWINDS a request's
checks block instead of rewinding again; a rewind restores the early-exit rule's state. Ordered by
events (a held reply, a spy), never by sleeps; the fixtures and helpers are test_verify_deferred's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from prometheus_client import generate_latest

from layerswarm.coordinator import ClassifyOptions, Policy
from layerswarm.coordinator.routing.deferred import MAX_REWINDS
from layerswarm.coordinator.verification.verifier import Lie, Screened
from layerswarm.harness.faults import FaultSpec
from layerswarm.node.server import Node
from layerswarm.wire.v1 import block_pb2 as pb

from ..swarm import wait_until
from .test_verify_deferred import SEQ, address, node, on_call, swarm


def held_until(served: Node, release: asyncio.Event) -> None:
    """`served` computes (and lies, when faulty) only once `release` is set (at most 10 s: a bug)."""
    handle = served.service._handle

    async def held(request: pb.ForwardRequest) -> pb.ForwardResponse:
        await asyncio.wait_for(release.wait(), 10.0)
        return await handle(request)

    served.service._handle = held  # type: ignore[method-assign]


async def test_a_hedge_loser_that_lied_is_convicted_and_the_request_is_not_rewound(family_dirs: list[Path]) -> None:
    """The liar (the coordinator's own model, asked first) holds its reply until hop 1 is called, so its
    hop is hedged to the honest replica, which wins. Its zeros then arrive as the loser's reply: its
    detached check convicts it, and the request (which never used that reply) is neither rewound nor
    changed: its answer is the all-honest one."""
    liar = node(family_dirs[0], 0, FaultSpec("zeros"))
    backup = node(family_dirs[1], 0)
    later = [node(family_dirs[0], b) for b in (1, 2)]
    hop_1_called = asyncio.Event()

    def started() -> None:
        held_until(liar, hop_1_called)
        on_call(later[0], hop_1_called.set)

    async with swarm(
        family_dirs[0],
        [liar, backup, *later],
        started,
        family_dirs=(family_dirs[1],),
        verify_rate=0.0,
        hedge_quantile=0.95,
        hedge_min_ms=5.0,
        hop_timeout_s=30.0,  # the held liar must lose the race, never time out (that would be a failure)
    ) as coord:
        liar_record = coord.registry.nodes[address(liar)]
        liar_record.recent_ms.extend([2.0] * 10)  # usually fast: held past 5 ms, its hop is hedged
        assert coord.verifier is not None
        x = torch.rand(2, 3, 16, 16)
        first = await coord.router.classify(x, SEQ)
        hop = first.path.hops[0]
        assert (hop.outcome, hop.node, hop.hedged_to) == ("hedged", address(backup), address(backup))
        assert not hop.attempts and not first.path.discarded
        await wait_until(lambda: liar_record.state.value == "quarantined", timeout=10, what="the loser convicted")
        assert liar_record.convicted and liar_record.evidence[0]["check"] == "re-execution"
        assert [d["address"] for d in coord.verifier.counters.detections] == [address(liar)]
        assert coord.verifier.counters.rewinds == 0  # the request it lost in was not rewound
        assert all(coord.registry.nodes[address(n)].failed == 0 for n in (backup, *later))
        again = await coord.router.classify(x, SEQ)  # the liar is out: the all-honest path
        assert [h.node for h in again.path.hops] == [h.node for h in first.path.hops]
        torch.testing.assert_close(first.probs, again.probs, rtol=0, atol=0)
        assert "layerswarm_verify_rewinds_total 0.0" in generate_latest(coord.metrics.registry).decode()


async def test_past_max_rewinds_the_remaining_checks_block_and_the_answer_is_the_honest_one(
    family_dirs: list[Path],
) -> None:
    """MAX_REWINDS + 1 liars of block 0 (the coordinator's own model: asked before the honest replica),
    each on probation. The first MAX_REWINDS are caught by deferred checks, each a rewind; then the
    request's checks block: the last liar is caught before its reply is used (a substitution, no rewind),
    and no deferred check starts after the last rewind. The answer is the all-honest one."""
    liars = [node(family_dirs[0], 0, FaultSpec("zeros")) for _ in range(MAX_REWINDS + 1)]
    honest = [node(family_dirs[1], 0), *(node(family_dirs[0], b) for b in (1, 2))]
    async with swarm(
        family_dirs[0], [*liars, *honest], family_dirs=(family_dirs[1],), verify_rate=0.0, hop_timeout_s=30.0
    ) as coord:
        verifier, executor = coord.verifier, coord.router.executor
        assert verifier is not None
        deferred_at: list[int] = []  # the rewinds so far whenever a deferred check starts
        start_check = executor._confirm

        def spy(screened: Screened) -> asyncio.Future[Lie | None]:
            deferred_at.append(verifier.counters.rewinds)
            return start_check(screened)

        executor._confirm = spy  # type: ignore[method-assign]
        x = torch.rand(2, 3, 16, 16)
        first = await coord.router.classify(x, SEQ)
        assert verifier.counters.rewinds == MAX_REWINDS
        hop = first.path.hops[0]
        assert (hop.outcome, hop.node) == ("substituted", address(honest[0]))
        assert sorted(a.node for a in hop.attempts) == sorted(address(n) for n in liars)  # each tried once
        assert all("verification failed" in a.error for a in hop.attempts)
        assert [h.node for h in first.path.hops[1:]] == [address(n) for n in honest[1:]]
        # each rewind threw away hops 1 and 2; the last liar, checked blocking, threw nothing away
        assert len(first.path.discarded) == 2 * MAX_REWINDS
        assert all(h.outcome == "discarded" for h in first.path.discarded)
        assert deferred_at and max(deferred_at) == MAX_REWINDS - 1  # deferred until the last rewind, not after
        for liar in liars:
            record = coord.registry.nodes[address(liar)]
            assert record.state.value == "quarantined" and record.evidence[0]["check"] == "re-execution"
        assert all(coord.registry.nodes[address(n)].failed == 0 for n in honest)
        again = await coord.router.classify(x, SEQ)  # every liar is out: the all-honest path, no rewind
        assert [h.node for h in again.path.hops] == [h.node for h in first.path.hops] and not again.path.discarded
        torch.testing.assert_close(first.probs, again.probs, rtol=0, atol=0)
        assert verifier.counters.rewinds == MAX_REWINDS
        scraped = generate_latest(coord.metrics.registry).decode()
        assert f"layerswarm_verify_rewinds_total {float(MAX_REWINDS)}" in scraped


async def test_a_rewind_restores_the_patience_streak_of_the_early_exit_rule(family_dirs: list[Path]) -> None:
    """Patience 1, minimum depth 1, and a head whose top class never changes (its probabilities still
    follow the activations): a path exits after its second hop. The liar's lie at hop 0 ran two hops and
    exited; the rewind must reset the streak to its state before hop 0, or the rerun would exit after
    hop 0 on a streak built from the lie. The answer is the all-honest one (same hops, same numbers)."""
    liar = node(family_dirs[0], 0, FaultSpec("zeros"))
    honest = [node(family_dirs[1], 0), *(node(family_dirs[0], b) for b in (1, 2))]
    opts = ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0, min_blocks=1, exit_rule="patience", exit_threshold=1)
    async with swarm(
        family_dirs[0], [liar, *honest], family_dirs=(family_dirs[1],), verify_rate=0.0, hop_timeout_s=30.0
    ) as coord:
        head = coord.router.head_logits

        async def class_0_on_top(x: torch.Tensor) -> torch.Tensor:
            logits = await head(x)
            return torch.cat([logits.max(-1, keepdim=True).values + 1.0, logits[:, 1:]], -1)

        coord.router.head_logits = class_0_on_top  # type: ignore[method-assign]
        x = torch.rand(2, 3, 16, 16)
        first = await coord.router.classify(x, opts)
        assert coord.verifier is not None and coord.verifier.counters.rewinds == 1
        assert first.path.exited_early and first.exit_rule == "patience"
        assert [h.node for h in first.path.hops] == [address(n) for n in honest[:2]]  # exited after hop 1
        assert [(h.block, h.node) for h in first.path.discarded] == [(1, address(honest[1]))]  # the lie's hop 1
        assert coord.registry.nodes[address(liar)].state.value == "quarantined"
        again = await coord.router.classify(x, opts)  # the liar is out: the all-honest path
        assert [h.node for h in again.path.hops] == [h.node for h in first.path.hops] and again.path.exited_early
        torch.testing.assert_close(first.path.activations, again.path.activations, rtol=0, atol=0)
        torch.testing.assert_close(first.probs, again.probs, rtol=0, atol=0)
