"""Which hops are re-executed, and the guarantee that follows (pure: no tensors, no I/O).

A hop of a node is re-executed when any of these holds (verifier.py applies them, executor.py the last):

1. probation: the node's incarnation has passed fewer than `probation_hops` checks (2);
2. suspicion: the hop's output is outside the activation range evaluated for its position, or is
   not residual-like (anomaly.py: a block adds to its input; noise, zeros or another input's output
   do not): a change of behaviour, checked at once and watched closely for the next SUSPICION_HOPS hops;
3. decisive: it is the hop that changed the answer's class distribution most (decisive.py), checked
   before the answer is returned: a lie that makes itself the answer's reason is checked on its answer;
4. sampling: otherwise with probability `check_probability`: NEW_NODE_BOOST times `rate` for a node that
   has passed few checks, decaying with every passed check to PROVEN_SHARE of `rate` for long-proven
   ones, and SUSPICION_BOOST times `rate` for a node under suspicion.

The guarantee from sampling alone (whatever a liar chooses): every hop of a node is checked with
probability at least q = check_probability(rate, passed, ...), independently of what the node sends, so
a node that lies on a share p of its hops escapes H of its hops with probability at most (1 - p q)^H
(`escape_probability`). At the default rate 0.05: q = 0.25 for a new node, decaying to the floor
q = 0.13 for long-proven ones, so a node that lies on every hop, however long it was honest before, is
caught within 34 of its hops with probability at least 0.99 (`hops_for`), one lying on half of them
within 69. Rarer liars are where 2. and 3. do the work: a lie that is not residual-like is checked at
the first one, and a lie that changes an answer is usually that answer's decisive hop. How often, for a
turncoat, a 5 % liar and a subtle targeted liar over 100 seeds: `python -m layerswarm.bench.verify_sim`
(docs/trust-verification.md). The price: the floor, probation, suspicion and one decisive hop per
answer are re-executed (the share of hops is in the same report and in /v1/nodes' verification stats).
"""

from __future__ import annotations

import math

NEW_NODE_BOOST = 5.0  # a node that has passed no check yet is sampled at this times the rate (0.25)
PROVEN_SHARE = 2.6  # ... and one proven by many passed checks at this share of it (0.13 at the default)
TRUST_SCALE = 25.0  # passed checks over which the boost decays by e
SUSPICION_BOOST = 4.0  # after a suspicious hop (out of range, not residual-like)
SUSPICION_HOPS = 50  # ... for this many of the node's hops


def check_probability(rate: float, passed: int, suspicious: bool) -> float:
    """The chance that a hop of a node past probation is drawn for re-execution."""
    trust = PROVEN_SHARE + (NEW_NODE_BOOST - PROVEN_SHARE) * math.exp(-passed / TRUST_SCALE)
    boost = max(trust, SUSPICION_BOOST) if suspicious else trust
    return min(1.0, rate * boost)


def escape_probability(lie_share: float, check: float, hops: int) -> float:
    """The chance that a node lying on `lie_share` of its hops, each checked with probability `check`,
    is not caught in `hops` of its hops."""
    return (1.0 - lie_share * check) ** hops


def hops_for(confidence: float, lie_share: float, check: float) -> int:
    """Hops of a node after which it is caught with at least `confidence` (sampling alone)."""
    caught_per_hop = lie_share * check
    if caught_per_hop <= 0:
        raise ValueError("a node that never lies, or is never checked, is never caught")
    if caught_per_hop >= 1:
        return 1
    return math.ceil(math.log(1.0 - confidence) / math.log(1.0 - caught_per_hop))
