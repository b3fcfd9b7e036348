"""Self-speculative greedy decoding (LayerSkip): the first d blocks of the route and the shared head draft
k tokens, the rest of the route verifies them in one pass, and the output is exactly plain greedy's.

    loop:  last token t (not yet in any cache)
      draft    t, d1 .. dk through blocks[:d] one at a time (their caches grow by k + 1); d(i+1) = argmax head
      verify   the k + 1 states after blocks[:d] through blocks[d:] in ONE call (one trip through the swarm)
               -> g0 .. gk, the full route's greedy token after t, d1 .. dk
      accept   d1 .. dj while d(i+1) == g(i); then emit g(j) (the correction, or a bonus token when j = k)
      rollback every cache keeps t, d1 .. dj: truncate(length before + j + 1)

The draft's blocks are the route's own first blocks, so their keys and values serve both: nothing is
computed twice, and what the verify pass sees is what plain decoding would have computed. Batch 1 (one
stream), as a coordinator runs it per stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .cache import KVCache
from .generate import CachedBlock, empty_caches, pad_right


@dataclass
class SpeculationStats:
    trips: int = 0  # verify passes through blocks[d:] (plain decoding makes one per token)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_trip(self) -> float:
        return self.emitted / self.trips if self.trips else 0.0


@torch.no_grad()
def speculative_generate(
    stem: nn.Module,
    blocks: Sequence[CachedBlock],
    head: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    draft_depth: int,
    k: int,
    eos_id: int = -1,
    stats: SpeculationStats | None = None,
) -> list[int]:
    """Greedy continuation of `prompt` (eos not included), identical to generate.generate's greedy one."""
    if not 1 <= draft_depth < len(blocks) or k < 1:
        raise ValueError(f"draft depth must be in 1..{len(blocks) - 1} and k at least 1")
    stats = stats if stats is not None else SpeculationStats()
    draft, rest = list(blocks[:draft_depth]), list(blocks[draft_depth:])
    caches = empty_caches(blocks, 1)
    context = min(b.max_seq_len for b in blocks)
    room = min(max_new_tokens, context - len(prompt))
    tokens, lengths = pad_right([prompt])
    x = stem(tokens)
    for block, cache in zip(blocks, caches, strict=True):
        x = block(x, caches=cache, new_tokens=lengths)
    last = int(head(x[:, -1]).argmax(-1))  # the first new token: the full route's, no draft yet
    stats.trips += 1
    out: list[int] = []
    while room > 0 and last != eos_id:
        out.append(last)
        room -= 1
        if room == 0:
            break
        span = min(k, room - 1, context - caches[0][0].length - 1)  # drafts the context has room to verify
        states, drafts = _draft(stem, draft, head, caches[:draft_depth], last, span)
        verified = _verify(rest, head, caches[draft_depth:], states)  # (span + 1,) the route's own picks
        accepted = 0
        while accepted < span and drafts[accepted] == int(verified[accepted]):
            accepted += 1
        stats.trips += 1
        stats.drafted += span
        stats.accepted += accepted
        keep = caches[0][0].length - (span + 1) + accepted + 1
        for cache in caches:
            cache[0].truncate(keep)
        for token in drafts[:accepted]:
            if token == eos_id or room == 0:
                room = 0
                break
            out.append(token)
            room -= 1
        last = int(verified[accepted])
        if room == 0:
            break
    stats.emitted += len(out)
    return out


def _draft(
    stem: nn.Module, draft: list[CachedBlock], head: nn.Module, caches: list[list[KVCache]], last: int, span: int
) -> tuple[Tensor, list[int]]:
    """last and `span` drafted tokens through the draft blocks: their states (1, span + 1, D) and the drafts."""
    token, states, drafts = last, [], []
    for i in range(span + 1):
        h = stem(torch.tensor([[token]]))
        for block, cache in zip(draft, caches, strict=True):
            h = block(h, caches=cache)
        states.append(h)
        if i < span:
            token = int(head(h[:, -1]).argmax(-1))
            drafts.append(token)
    return torch.cat(states, dim=1), drafts


def _verify(rest: list[CachedBlock], head: nn.Module, caches: list[list[KVCache]], states: Tensor) -> Tensor:
    """The states through the remaining blocks in one call: (span + 1,) greedy tokens after each."""
    h = states
    for block, cache in zip(rest, caches, strict=True):
        h = block(h, caches=cache)
    return head(h[0]).argmax(-1)
