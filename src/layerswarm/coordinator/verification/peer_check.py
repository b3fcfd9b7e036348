"""Spot re-execution on other nodes: the same hop, sent to a replica with the same weights hash.

A coordinator on a small device cannot afford to run every checked hop itself (one ViT-B/16 block is
~100 ms on a Raspberry Pi-class CPU), and one that holds no copy of a model (an unlisted member, non-strict
mode) has nothing better than the family envelope. Other nodes that serve the very same weights
(same model id, block index and sha256) can: honest replicas agree to within the wire dtype's rounding.

Peers are never trusted to convict, and a majority of them never decides anything: replicas can
collude (three nodes returning the same wrong output outvoted an honest one and got it convicted,
before this rule). So:

- the node agrees with the referee: it passes (its reply matches a second computation);
- they disagree and the coordinator holds the model: its verified copy decides, alone. The node is
  convicted if its reply differs from the copy, the referee if the referee's does (both, if both do);
- they disagree and the coordinator holds no copy: the weights are contested. Nobody is convicted,
  and no replica of them is routed to for a while (membership/registry.py: contest), since nothing
  says which side lied: a colluding majority can get honest replicas of such weights refused (a
  denial of service), never convicted, and never gets its lie accepted once an honest replica
  referees it.

An agreement can still be two colluders agreeing on a lie: the executor re-executes the answer's decisive
hop on the coordinator's own copy whenever it holds one (decisive.py), so a lie that changes an answer
meets a referee it cannot pick. Referees that passed their own probation are asked first, at random
among them (a liar cannot predict which replica checks it). A referee that fails to answer is passed
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
Referee = Callable[[], Awaitable[torch.Tensor | None]]  # the coordinator's own verified copy


@dataclass(frozen=True)
class PeerVerdict:
    """What the check found. `convicted`: addresses caught lying by the coordinator's copy (the node
    checked, a referee, or both); `contested`: a disagreement nobody here can settle."""

    passed: bool
    convicted: tuple[str, ...] = ()
    evidence: Evidence | None = None
    contested: bool = False
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
    own_copy: Referee | None = None,
) -> PeerVerdict | None:
    """`node`'s reply against the first referee that answers; a disagreement is settled by `own_copy`
    (the coordinator's verified copy) or, without one, contested. None: no referee answered."""
    asked = 0
    for peer in referees:
        ref = await ask(peer)
        asked += 1
        if ref is None:
            continue
        err = disagreement(ref)
        if err <= tolerance:
            return PeerVerdict(passed=True, asked=asked)
        copy = await own_copy() if own_copy is not None else None
        if copy is None:
            evidence = _evidence("contested", node, peer.address, err, tolerance)
            return PeerVerdict(passed=False, evidence=evidence, contested=True, asked=asked)
        return _decided_by_copy(node, peer.address, ref, copy, disagreement, tolerance, asked)
    return None


def _decided_by_copy(
    node: NodeRecord,
    referee: str,
    referee_ref: torch.Tensor,
    copy: torch.Tensor,
    disagreement: Compare,
    tolerance: float,
    asked: int,
) -> PeerVerdict:
    """Node and referee disagree: whoever differs from the coordinator's own copy lied."""
    against = "the coordinator's verified copy"
    node_err, referee_err = disagreement(copy), relative_error(referee_ref, copy)
    liars = tuple(a for a, e in ((node.address, node_err), (referee, referee_err)) if e > tolerance)
    if node.address in liars:
        evidence = _evidence("re-execution on peers", node, f"{against} (referee {referee})", node_err, tolerance)
        return PeerVerdict(passed=False, convicted=liars, evidence=evidence, asked=asked)
    evidence = _evidence("re-execution on peers", node, against, referee_err, tolerance, referee=referee)
    return PeerVerdict(passed=True, convicted=liars, evidence=evidence, asked=asked)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS of the difference over RMS of the reference `b`."""
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
    if referee is not None:  # the lie was the referee's: it disagreed with the node and the coordinator's copy
        data["against"] = f"{node.address} and {against}: {claim} (referee {referee} lied)"
    return data
