"""Generation through any list of blocks (one model's route, a pruned one, a merge of several models).

    prompts -> Route.prefill (all prompt tokens, one call per block) -> logits of the last token
            -> pick_next -> Route.step (one token per row, one call per block) -> ...

This is the reference the swarm's streaming is compared with: a node's block gets exactly these calls
(prefill, then one token at a time), and the same Sampling with the same seed picks the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from .cache import KVCache


class CachedBlock(Protocol):
    """What generation needs of a block (model.DecoderBlock is one)."""

    max_seq_len: int

    def new_cache(self) -> KVCache: ...

    def __call__(
        self,
        x: Tensor,
        start: Tensor | None = None,
        caches: Sequence[KVCache] | None = None,
        new_tokens: Tensor | None = None,
    ) -> Tensor: ...


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy at temperature 0, else sampled from the softmax at this
    temperature, among the top_k most likely (0: all) within top_p of the probability mass (1: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_k must be at least 0 and top_p in (0, 1], got {self.top_k} and {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        gen = torch.Generator()
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def next_token_probs(logits: Tensor, sampling: Sampling) -> Tensor:
    """(B, V) logits -> (B, V) the distribution a sampled token is drawn from (top-k and top-p applied)."""
    scaled = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, index = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)  # the first always stays
        probs = torch.zeros_like(probs).scatter(-1, index, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def pick_next(logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> Tensor:
    """(B, V) logits -> (B,) next token ids."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = next_token_probs(logits, sampling)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)


def pad_right(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """(B, T) token ids, each prompt left-aligned and padded on the right, and (B,) their lengths."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("every prompt needs at least one token")
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
    return tokens, lengths


def empty_caches(blocks: Sequence[CachedBlock], rows: int) -> list[list[KVCache]]:
    """[block][row] empty caches shaped for each block's attention."""
    return [[block.new_cache() for _ in range(rows)] for block in blocks]


class Route:
    """A batch of streams through one list of blocks, with their caches: prefill once, then step."""

    def __init__(self, stem: nn.Module, blocks: Sequence[CachedBlock], head: nn.Module, rows: int) -> None:
        self.stem, self.blocks, self.head = stem, list(blocks), head
        self.caches = empty_caches(self.blocks, rows)
        self.context = min(b.max_seq_len for b in self.blocks) if self.blocks else 1 << 30

    @property
    def lengths(self) -> list[int]:
        return [c.length for c in self.caches[0]] if self.caches else []

    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Every prompt's tokens through the blocks -> (B, V) logits after each prompt's last token."""
        tokens, lengths = pad_right(prompts)
        x = self.stem(tokens)
        for block, caches in zip(self.blocks, self.caches, strict=True):
            x = block(x, caches=caches, new_tokens=lengths)
        return self.head(x[torch.arange(len(prompts)), lengths - 1])

    def step(self, tokens: Tensor) -> Tensor:
        """One token per row (B,) -> (B, V) logits for the token after it."""
        x = self.stem(tokens[:, None])
        for block, caches in zip(self.blocks, self.caches, strict=True):
            x = block(x, caches=caches)
        return self.head(x[:, -1])


def generate(
    stem: nn.Module,
    blocks: Sequence[CachedBlock],
    head: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_id: int = -1,
    sampling: Sampling | None = None,
) -> list[list[int]]:
    """Each prompt's continuation (eos not included), at most max_new_tokens and within the context."""
    sampling = sampling or Sampling()
    generator = None if sampling.greedy else sampling.generator()
    route = Route(stem, blocks, head, len(prompts))
    room = min(max_new_tokens, route.context - max(len(p) for p in prompts))
    out: list[list[int]] = [[] for _ in prompts]
    if room <= 0:
        return out
    logits = route.prefill(prompts)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    for step in range(room):
        token = pick_next(logits, sampling, generator)
        for row in range(len(prompts)):
            if not done[row]:
                if int(token[row]) == eos_id:
                    done[row] = True
                else:
                    out[row].append(int(token[row]))
        if bool(done.all()) or step + 1 == room:
            break
        logits = route.step(token)
    return out
