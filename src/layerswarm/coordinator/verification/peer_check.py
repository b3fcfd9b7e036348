"""Spot re-execution on other nodes: the same hop, sent to replicas with the same weights hash.

A coordinator on a small device cannot afford to run every sampled hop itself (one ViT-B/16 block is
~100 ms on a Raspberry Pi-class CPU), and one that holds no copy of a model (an unlisted member, non-strict
mode) has nothing better than the family envelope. Other nodes that serve the very same weights
(same model id, block index and sha256) can: honest replicas agree to within the wire dtype's rounding.

Judgement is by majority, never by one peer's word (the referee may be the liar):

- the node agrees with its first referee: it passes;
- it disagrees, and a second referee (or the coordinator's own verified copy) agrees with the first:
  the node is convicted;
- the second opinion sides with the node instead: the first referee is the one convicted;
- no second opinion can be had: the disagreement is recorded (evidence on both, in `/v1/nodes`
  through the verifier's stats) and nobody is convicted on one node's word against another's.

Referees that passed their own probation are asked first. A referee that fails to answer is passed
over (its failure is the executor's business, not evidence about the node being checked).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from ..membership.records import Evidence, NodeRecord

Ask = Callable[[NodeRecord], Awaitable[torch.Tensor | None]]  # this hop's input on another node; None: no answer
Compare = Callable[[torch.Tensor], float]  # relative error of a reference against the node's reply
Referee = Callable[[], Awaitable[torch.Tensor | None]]  # a second opinion that is not a peer (the coordinator)


@dataclass(frozen=True)
class PeerVerdict:
    """What the peers said. `liar`: the address convicted (the node checked or a referee), None when
    the node passed or nothing could be decided; `evidence` says what was compared with what."""

    passed: bool
    liar: str | None = None
    evidence: Evidence | None = None
    asked: int = 0


def same_weights(record: NodeRecord, others: list[NodeRecord]) -> list[NodeRecord]:
    """Routable nodes that serve exactly the weights `record` claims (model, block, sha256)."""
    mine = record.identity
    if mine is None:
        return []
    return [
        r
        for r in others
        if r.address != record.address
        and r.routable
        and r.identity is not None
        and (r.identity.model_id, r.identity.block, r.identity.weights_sha256)
        == (mine.model_id, mine.block, mine.weights_sha256)
    ]


def order_referees(replicas: list[NodeRecord], trusted: Callable[[str], bool], rng: random.Random) -> list[NodeRecord]:
    """Referees that passed their probation first, random within each group (a liar cannot predict
    which replica will check it)."""
    shuffled = list(replicas)
    rng.shuffle(shuffled)
    return sorted(shuffled, key=lambda r: not trusted(r.address))


async def judge(
    node: NodeRecord,
    referees: list[NodeRecord],
    ask: Ask,
    disagreement: Compare,
    tolerance: float,
    fallback: Referee | None = None,
) -> PeerVerdict | None:
    """Majority judgement of `node`'s reply by up to two referees, and the coordinator's copy
    (`fallback`) as the tie-breaker. None: no referee answered (the caller judges another way)."""
    asked = 0
    first: tuple[NodeRecord, torch.Tensor] | None = None
    for peer in referees:
        ref = await ask(peer)
        asked += 1
        if ref is None:
            continue
        err = disagreement(ref)
        if first is None:
            if err <= tolerance:
                return PeerVerdict(passed=True, asked=asked)
            first = (peer, ref)
            continue
        return _second_opinion(node, first, peer.address, ref, err, disagreement, tolerance, asked)
    if first is None:
        return None
    if fallback is not None and (ref := await fallback()) is not None:
        return _second_opinion(
            node, first, "the coordinator's verified copy", ref, disagreement(ref), disagreement, tolerance, asked
        )
    return PeerVerdict(
        passed=False,
        evidence=_evidence("unresolved", node, first[0].address, disagreement(first[1]), tolerance),
        asked=asked,
    )


def _second_opinion(
    node: NodeRecord,
    first: tuple[NodeRecord, torch.Tensor],
    second_name: str,
    second_ref: torch.Tensor,
    node_vs_second: float,
    disagreement: Compare,
    tolerance: float,
    asked: int,
) -> PeerVerdict:
    referee, first_ref = first
    if node_vs_second <= tolerance:  # two against the first referee: it is the one that lied
        err = _relative(first_ref, second_ref)
        evidence = _evidence("re-execution on peers", node, second_name, err, tolerance, referee=referee.address)
        return PeerVerdict(passed=True, liar=referee.address, evidence=evidence, asked=asked)
    evidence = _evidence(
        "re-execution on peers", node, f"{referee.address} and {second_name}", disagreement(first_ref), tolerance
    )
    return PeerVerdict(passed=False, liar=node.address, evidence=evidence, asked=asked)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-6))


def _evidence(
    check: str, node: NodeRecord, against: str, err: float, tolerance: float, referee: str | None = None
) -> Evidence:
    ident = node.identity
    claim = f"{ident.model_id} block {ident.block} (sha256 {ident.weights_sha256[:12]})" if ident else "?"
    data: Evidence = {
        "check": check,
        "against": f"{against}, serving the same weights: {claim}",
        "discrepancy": f"relative RMS error {err:.4g}",
        "tolerance": round(tolerance, 6),
    }
    if referee is not None:  # the lie was the referee's: it disagreed with the node and a second opinion
        data["against"] = f"{node.address} and {against}, serving the same weights: {claim}"
    return data
