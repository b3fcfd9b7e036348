"""What one route (a stem, any list of blocks, a head) scores on held-out data.

    perplexity   exp(mean negative log-likelihood) of the target tokens, per source: "tasks" (the answers)
                 and "text" (every token of the held-out paragraphs)
    exact match  the share of test prompts whose greedy answer is exactly right, overall and per task

Scores are flat dicts ("ppl/text", "em", "em/add", ...), so summaries over orders and merges are per key.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor, nn

from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.generate import CachedBlock, Route, Sampling, generate, pick_next

from .data import LMData, TokenRows, prompt_ids
from .tasks import Example

Scores = dict[str, float]


@dataclass
class Parts:
    """What a route needs besides its blocks: the (first member's) stem and head."""

    stem: nn.Module
    head: nn.Module


@torch.no_grad()
def target_logprobs(parts: Parts, blocks: Sequence[nn.Module], rows: TokenRows, batch: int = 128) -> Tensor:
    """(M,) float64 log-probability of every target token of `rows` through `blocks`, in row order."""
    out = []
    for i in range(0, len(rows), batch):
        ids, mask = rows.ids[i : i + batch], rows.loss[i : i + batch, 1:]
        x = parts.stem(ids[:, :-1])
        for block in blocks:
            x = block(x)
        logits = parts.head(x[mask])  # (m, V): the head only where a target is
        out.append(-F.cross_entropy(logits.float(), ids[:, 1:][mask], reduction="none").double())
    return torch.cat(out)


def perplexity(logprobs: Tensor) -> float:
    return math.exp(-float(logprobs.mean()))


class Answers:
    """The test prompts of a data set, encoded once, and how long an answer may be."""

    def __init__(self, examples: Sequence[Example], tok: Tokenizer, cfg: LMConfig) -> None:
        self.examples = list(examples)
        self.tok, self.cfg = tok, cfg
        self.prompts = [prompt_ids(tok, cfg, e) for e in self.examples]
        lengths = [len(tok.encode(e.answer, add_special_tokens=False).ids) for e in self.examples]
        self.max_new = max(lengths, default=0) + 1  # and </s>

    def hits(self, outputs: Sequence[Sequence[int]]) -> Tensor:
        """(N,) float64: 1 where the generated ids decode to exactly the answer."""
        right = [self.tok.decode(list(o)) == e.answer for o, e in zip(outputs, self.examples, strict=True)]
        return torch.tensor(right, dtype=torch.float64)

    def scores(self, hits: Tensor) -> Scores:
        by_task: dict[str, list[float]] = defaultdict(list)
        for e, h in zip(self.examples, hits.tolist(), strict=True):
            by_task[e.task].append(h)
        return {"em": float(hits.mean()), **{f"em/{t}": sum(v) / len(v) for t, v in sorted(by_task.items())}}


@torch.no_grad()
def greedy_hits(parts: Parts, blocks: Sequence[CachedBlock], answers: Answers, batch: int = 500) -> Tensor:
    outputs: list[list[int]] = []
    for i in range(0, len(answers.prompts), batch):
        prompts = answers.prompts[i : i + batch]
        outputs += generate(parts.stem, blocks, parts.head, prompts, answers.max_new, answers.cfg.eos_id)
    return answers.hits(outputs)


def route_scores(parts: Parts, blocks: Sequence[CachedBlock], data: LMData, answers: Answers | None) -> Scores:
    """Perplexity per test source and, with task prompts, exact match: one route's row of the report."""
    scores: Scores = {}
    for rows in data.test:
        scores[f"ppl/{rows.source}"] = perplexity(target_logprobs(parts, blocks, rows))  # type: ignore[arg-type]
    if answers is not None and answers.examples:
        scores.update(answers.scores(greedy_hits(parts, blocks, answers)))
    return scores


@torch.no_grad()
def ensemble_scores(
    routes: Sequence[tuple[Parts, Sequence[CachedBlock]]], data: LMData, answers: Answers | None
) -> Scores:
    """The members' mean probabilities: perplexity of the mixture, and greedy exact match on the mixture."""
    scores: Scores = {}
    for rows in data.test:
        logprobs = torch.stack([target_logprobs(p, b, rows) for p, b in routes])  # type: ignore[arg-type]
        mixture = torch.logsumexp(logprobs, dim=0) - math.log(len(routes))
        scores[f"ppl/{rows.source}"] = perplexity(mixture)
    if answers is not None and answers.examples:
        outputs = ensemble_generate(routes, answers.prompts, answers.max_new, answers.cfg.eos_id)
        scores.update(answers.scores(answers.hits(outputs)))
    return scores


def ensemble_generate(
    routes: Sequence[tuple[Parts, Sequence[CachedBlock]]], prompts: Sequence[Sequence[int]], max_new: int, eos_id: int
) -> list[list[int]]:
    """Greedy on the mean of the members' next-token probabilities, every member keeping its own caches."""
    steppers = [Route(p.stem, b, p.head, len(prompts)) for p, b in routes]
    probs = torch.stack([torch.softmax(s.prefill(prompts).float(), -1) for s in steppers]).mean(0)
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    room = min(max_new, min(s.context for s in steppers) - max(len(p) for p in prompts))
    for step in range(room):
        token = pick_next(probs, Sampling())
        for row in range(len(prompts)):
            if not done[row]:
                done[row] = int(token[row]) == eos_id
                if not done[row]:
                    out[row].append(int(token[row]))
        if bool(done.all()) or step + 1 == room:
            break
        probs = torch.stack([torch.softmax(s.step(token).float(), -1) for s in steppers]).mean(0)
    return out
