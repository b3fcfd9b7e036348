"""The speculative acceptance rule, for any draft and any verifier (a swarm's route, a monolith's).

    greedy   draft d(i) = argmax q(i); keep d(1) .. d(j) while d(i) == argmax p(i); the next token is
             argmax p(j + 1): exactly plain greedy decoding's tokens, whatever the draft
    sampled  (Leviathan et al. 2023, Chen et al. 2023) d(i) ~ q(i); keep d(i) with probability
             min(1, p(i)[d] / q(i)[d]); at the first rejection draw from the residual max(0, p - q),
             normalized; every token is then distributed as p, whatever the draft

p(i) and q(i) are next_token_probs of the verifier's and the draft's logits under the same Sampling
(temperature, top-k, top-p), so the target is plain sampling's distribution.

Randomness is keyed by position, not drawn from one running generator: the draws for the n-th generated
token come from generators seeded with (seed, n, purpose). The position after the last draft (the "bonus"
token when every draft is kept) is judged the same way, against a draft drawn there too, so a token's
value depends on the seed and the text before it only, never on k: same seed, same text, at any k and
when k adapts. (Plain decoding draws from one running generator: its text for a seed differs.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .generate import Sampling, next_token_probs

DRAFT, ACCEPT, RESIDUAL = 0, 1, 2  # what a position's generator is for


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts kept
    token: int  # the token after them: the correction at the first rejection, or the bonus token


def keyed_generator(seed: int, position: int, purpose: int) -> torch.Generator:
    """A generator for one draw: the seed, the generated token's index and what it is drawn for."""
    digest = hashlib.blake2b(f"{seed}:{position}:{purpose}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def draft_probs(logits: Tensor, sampling: Sampling) -> Tensor:
    """(N, V) logits -> (N, V) the distribution each position is drawn from (sampled decoding only)."""
    return next_token_probs(logits, sampling)


def draw(probs: Tensor, seed: int, position: int, purpose: int) -> int:
    """One token from (V,) probabilities with the position's generator."""
    return int(torch.multinomial(probs, 1, generator=keyed_generator(seed, position, purpose)))


def judge(
    p_logits: Tensor,
    drafts: Sequence[int],
    sampling: Sampling,
    q: Tensor | None = None,
    first_position: int = 0,
) -> Verdict:
    """The verifier's logits p_logits (n + 1, V) after the last kept token and each of n drafts, against
    the drafts. Greedy: `drafts` are the n drafts (argmax of the draft). Sampled: n + 1 drafts, the last
    one drawn at the bonus position, with q (n + 1, V) the draft's probabilities they were drawn from, and
    first_position the generated index of the first of them (keys the random draws)."""
    n = p_logits.shape[0] - 1
    if sampling.greedy:
        if len(drafts) < n:
            raise ValueError(f"{n + 1} verified positions need {n} drafts, got {len(drafts)}")
        picks = p_logits.argmax(-1).tolist()
        accepted = 0
        while accepted < n and drafts[accepted] == picks[accepted]:
            accepted += 1
        return Verdict(accepted, int(picks[accepted]))
    if q is None or len(drafts) != n + 1 or q.shape != p_logits.shape:
        raise ValueError(f"sampled judging needs {n + 1} drafts and their probabilities, {tuple(p_logits.shape)}")
    assert sampling.seed is not None, "sampled speculation needs a seed (the generator sets one)"
    p = next_token_probs(p_logits, sampling)
    for i in range(n + 1):
        position, token = first_position + i, drafts[i]
        u = float(torch.rand((), generator=keyed_generator(sampling.seed, position, ACCEPT)))
        if u * float(q[i, token]) < float(p[i, token]):  # u < p/q, without dividing by a tiny q
            if i < n:
                continue
            return Verdict(n, token)  # the bonus position's draft, kept: distributed as p all the same
        return Verdict(i, draw(residual(p[i], q[i]), sampling.seed, position, RESIDUAL))
    raise AssertionError("unreachable: the last position always returns")


def residual(p: Tensor, q: Tensor) -> Tensor:
    """max(0, p - q) normalized: what a rejected draft's token is drawn from. All zero only when p <= q
    everywhere, i.e. p == q, where no draft is ever rejected; p then, as a guard against rounding."""
    left = (p - q).clamp_min(0.0)
    total = float(left.sum())
    return left / total if total > 0 else p
