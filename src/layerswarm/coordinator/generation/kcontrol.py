"""How many tokens a stream drafts before each verify trip, from what it measured (pure logic).

A round drafts k tokens locally (k x draft_s) and sends k + 1 through the route in one trip
(trip_base_s + k x trip_per_token_s), and yields E(k) = 1 + S(1) + ... + S(k) tokens, S(i) being the
chance that the first i drafts are all kept. The controller picks

    k* = argmax over k in [k_min, k_max] of  E(k) / (k x draft_s + trip_base_s + k x trip_per_token_s)

S comes from the rounds themselves, position by position (a survival estimate): of the rounds whose
drafts got as far as position i, the share rejected there. Acceptance is not independent from one draft
to the next (measured on the shipped family: a k = 4 draft yields 2.6 tokens a trip where independent
drafts kept 44% of the time would give 1.75): a draft that is right tends to stay right for a while, so
deep positions are rejected less often than the first, and the per-position estimate sees it. A
position with few rounds behind it leans on the one before it (PSEUDO_ROUNDS).

Slow hops (a large trip_base_s) make long drafts pay even at a modest acceptance; a draft that is seldom
kept, or a draft as slow as a hop, keeps k short. Every figure is an exponentially weighted average of
the stream's own rounds; the trip's cost per extra token comes from a weighted least-squares line over
(k, trip time), kept at 0 until the rounds have tried different k (the controller tries k + 1 now and
then while its guess rests, so the line has points to stand on).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

DECAY = 0.8  # weight kept by the past at each round (the times and the trip line)
POSITION_DECAY = 0.97  # the same for the per-position counts: each position sees only some rounds
PSEUDO_ROUNDS = 2.0  # how many rounds' worth a position's estimate borrows from the position before it
PROBE_EVERY = 8  # rounds at a settled k before one round tries k + 1 (the trip-cost line needs spread)


@dataclass
class _Line:
    """Exponentially weighted least squares of y on x."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = DECAY
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    def fit(self) -> tuple[float, float]:
        """(intercept, slope >= 0); slope 0 while every x was about the same."""
        if self.w == 0:
            return 0.0, 0.0
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        slope = max(0.0, (self.xy / self.w - mx * my) / var) if var > 0.05 else 0.0
        return max(0.0, my - slope * mx), slope


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round of k drafts yields when each is kept with probability `acceptance`, independently
    (what the controller starts from, before it has counts by position)."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class KController:
    k_min: int = 1
    k_max: int = 8
    acceptance: float = 0.5  # a prior until the first rounds (the family's evaluated acceptance, if known)
    draft_s: float = 0.0  # seconds to draft one token locally
    rounds: int = 0
    _trips: _Line = field(default_factory=_Line)
    _settled: int = 0  # rounds in a row at the chosen k
    _reached: list[float] = field(default_factory=list)  # [i]: rounds whose drafts got to position i + 1
    _rejected: list[float] = field(default_factory=list)  # [i]: ... and were rejected there

    def observe(self, drafted: int, accepted: int, draft_s: float, trip_s: float) -> None:
        """One round: drafts made and kept, the local drafting's seconds, the verify trip's seconds."""
        self.rounds += 1
        if drafted > 0:
            w = DECAY**drafted  # a long round says more than a short one
            self.acceptance = w * self.acceptance + (1 - w) * accepted / drafted
            per = draft_s / drafted
            self.draft_s = per if self.rounds == 1 else DECAY * self.draft_s + (1 - DECAY) * per
            self._count(drafted, accepted)
        self._trips.add(float(drafted), trip_s)

    def _count(self, drafted: int, accepted: int) -> None:
        need = max(drafted, len(self._reached))
        self._reached = [POSITION_DECAY * r for r in self._reached] + [0.0] * (need - len(self._reached))
        self._rejected = [POSITION_DECAY * r for r in self._rejected] + [0.0] * (need - len(self._rejected))
        for i in range(min(accepted + 1, drafted)):
            self._reached[i] += 1
        if accepted < drafted:
            self._rejected[accepted] += 1

    def survival(self, k: int) -> list[float]:
        """[S(1) .. S(k)]: the chance that the first i drafts are all kept."""
        hazard, alive, out = 1.0 - self.acceptance, 1.0, []
        for i in range(k):
            reached = self._reached[i] if i < len(self._reached) else 0.0
            rejected = self._rejected[i] if i < len(self._rejected) else 0.0
            hazard = (rejected + PSEUDO_ROUNDS * hazard) / (reached + PSEUDO_ROUNDS)
            alive *= 1.0 - hazard
            out.append(alive)
        return out

    def expected(self, k: int) -> float:
        """Tokens a round of k drafts is expected to yield."""
        return 1.0 + sum(self.survival(k))

    def cost(self, k: int) -> float:
        """Seconds a round of k drafts is expected to take."""
        base, per_token = self._trips.fit()
        return k * self.draft_s + base + k * per_token

    def best(self) -> int:
        """k* for what has been measured (k_min's neighbour until a trip was timed)."""
        if self.rounds == 0:
            return max(self.k_min, min(2, self.k_max))
        scores = {k: self.expected(k) / max(self.cost(k), 1e-9) for k in self.ranged()}
        return max(scores, key=lambda k: (scores[k], -k))

    def fork(self) -> KController:
        """A new stream's controller starting from this one's measurements (the same route's trips and
        the same draft's cost; acceptance is the text's own, so it starts from here and moves)."""
        return replace(
            self, _trips=replace(self._trips), _settled=0, _reached=[*self._reached], _rejected=[*self._rejected]
        )

    def ranged(self) -> range:
        return range(self.k_min, self.k_max + 1)

    def next_k(self) -> int:
        """The k for the next round: k*, or k* + 1 once in PROBE_EVERY settled rounds."""
        k = self.best()
        self._settled += 1
        if self._settled >= PROBE_EVERY and k < self.k_max:
            self._settled = 0
            return k + 1
        return k
