"""The speculative acceptance rule and the local draft (models/lm/accept.py, draft.py): greedy verdicts are
plain greedy's picks; sampled verdicts are distributed as the verifier's p whatever the draft's q (a rule
that kept every draft would give q, one that resampled a rejection from p instead of the residual would
give neither); draws depend on the seed and the position only; the draft's caches hold what was kept."""

from __future__ import annotations

import torch

from layerswarm.models.lm.accept import DRAFT, Verdict, draw, judge, residual
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.draft import Drafter
from layerswarm.models.lm.generate import Sampling
from layerswarm.models.lm.model import DecoderLM

P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # far from P: total variation 0.5
DRAWS = 4000  # sampling noise: about 0.013 total variation on average, 0.045 is past 3x that


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / 2)


def empirical(tokens: list[int], v: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=v).float() / len(tokens)


def test_greedy_keeps_the_drafts_that_match_and_corrects_the_first_that_does_not() -> None:
    logits = torch.full((4, 6), -5.0)
    for row, pick in enumerate([3, 1, 4, 0]):
        logits[row, pick] = 5.0
    greedy = Sampling()
    assert judge(logits, [3, 1, 4], greedy) == Verdict(3, 0)  # all kept: the bonus token
    assert judge(logits, [3, 2, 4], greedy) == Verdict(1, 1)  # the second is wrong: corrected
    assert judge(logits, [0, 1, 4], greedy) == Verdict(0, 3)
    assert judge(logits[:1], [], greedy) == Verdict(0, 3)  # no drafts: plain greedy's step


def test_sampled_tokens_are_distributed_as_the_verifier_whatever_the_draft(one_torch_thread: None) -> None:
    """The first position of a 3-draft round, and a bonus-only round, over DRAWS seeds: the empirical
    distribution is within sampling noise of P, far from Q (0.5 away). Keeping every draft gives Q;
    drawing a rejected position from P instead of the residual gives 0.175 away from P."""
    logits = P.log().expand(3, 6).clone()
    firsts, bonus = [], []
    for seed in range(DRAWS):
        s = Sampling(temperature=1.0, seed=seed)
        drafts = [draw(Q, seed, i, DRAFT) for i in range(3)]
        firsts.append(_first_token(judge(logits, drafts, s, Q.expand(3, 6).clone()), drafts))
        bonus.append(judge(logits[:1], drafts[:1], s, Q[None].clone()).token)
    for tokens in (firsts, bonus):
        assert tv(empirical(tokens, 6), P) < 0.045
        assert tv(empirical(tokens, 6), Q) > 0.4


def _first_token(verdict: Verdict, drafts: list[int]) -> int:
    return drafts[0] if verdict.accepted > 0 else verdict.token


def test_a_rejected_draft_resamples_from_the_residual_not_from_p() -> None:
    """With p == q nothing is rejected; the residual of a rejection carries no mass where q covers p."""
    assert torch.allclose(residual(P, P), P)
    left = residual(P, Q)
    assert float(left[Q >= P].sum()) == 0.0 and abs(float(left.sum()) - 1.0) < 1e-6


def test_draws_depend_on_the_seed_and_the_position_only() -> None:
    assert draw(Q, 7, 3, DRAFT) == draw(Q, 7, 3, DRAFT)
    by_position = {draw(Q, 7, i, DRAFT) for i in range(40)}
    by_seed = {draw(Q, s, 3, DRAFT) for s in range(40)}
    assert len(by_position) > 3 and len(by_seed) > 3


def test_the_draft_proposes_the_shallow_model_greedy_tokens_and_keeps_what_was_kept() -> None:
    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=97, dim=32, depth=3, heads=4, kv_heads=2, max_seq_len=64)).eval()
    drafter = Drafter(model.cfg, model.stem, model.route()[:1], model.head)
    stream = drafter.stream()
    prompt = [1, 5, 9, 30]
    stream.prefill(prompt)
    proposal = stream.propose([*prompt, 11], 3, Sampling(), position=1)
    expected, ids = [], [*prompt, 11]
    with torch.inference_mode():
        for _ in range(3):
            x = model.stem(torch.tensor([ids]))
            logits = model.head(model.route()[0](x))[0, -1]
            expected.append(int(logits.argmax()))
            ids.append(expected[-1])
    assert proposal.drafts == expected and proposal.q is None
    assert stream.length == len(prompt) + 1 + 2  # the last draft is fed only when a later round needs it
    stream.keep(len(prompt) + 2)  # one draft kept
    again = stream.propose([*prompt, 11, expected[0], 50], 1, Sampling(), position=3)
    assert stream.length == len(prompt) + 3 and len(again.drafts) == 1
    sampled = stream.propose([*prompt, 11, expected[0], 50, again.drafts[0]], 2, Sampling(1.0, seed=3), position=4)
    assert len(sampled.drafts) == 3 and sampled.q is not None and sampled.q.shape == (3, 97)
