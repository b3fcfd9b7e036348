"""Per-token early exit (CALM, Schuster et al. 2022): a generated token leaves the route at the first block
after which the shared head is confident enough (its top probability at least `threshold`); the blocks it
skips still get its keys and values, computed from the state it exited with, so later tokens can attend
to it. Lossy: the exit rule is calibrated on held-out prompts (training/lm/draft_eval.py).

Prompts are prefilled at full depth; only generated tokens exit. `hops` counts the blocks a token really
needed (a swarm would skip the others' compute and, with a node that fills caches from the exit state,
their round trips); the caches are filled here by running the skipped blocks on the frozen state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .generate import CachedBlock, Route


@dataclass
class ExitStats:
    tokens: int = 0  # generated tokens
    hops: int = 0  # blocks those tokens ran through
    full_hops: int = 0  # blocks they would have run through without exits

    @property
    def hops_saved(self) -> float:
        return 1.0 - self.hops / self.full_hops if self.full_hops else 0.0


@torch.no_grad()
def early_exit_generate(
    stem: nn.Module,
    blocks: Sequence[CachedBlock],
    head: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    threshold: float,
    eos_id: int = -1,
    min_blocks: int = 1,
    stats: ExitStats | None = None,
) -> list[list[int]]:
    """Greedy continuations where each generated token stops at its first confident block (>= min_blocks)."""
    stats = stats if stats is not None else ExitStats()
    depth = len(blocks)
    route = Route(stem, blocks, head, len(prompts))
    room = min(max_new_tokens, route.context - max(len(p) for p in prompts))
    out: list[list[int]] = [[] for _ in prompts]
    if room <= 0:
        return out
    logits = route.prefill(prompts)
    live = torch.ones(len(prompts), dtype=torch.bool)  # rows still generating
    hops = torch.full((len(prompts),), depth)  # the first token: the prompt's full-depth pass
    for step in range(room):
        token = logits.argmax(-1)
        for row in range(len(prompts)):
            if live[row]:
                stats.tokens += 1
                stats.hops += int(hops[row])
                stats.full_hops += depth
                if int(token[row]) == eos_id:
                    live[row] = False
                else:
                    out[row].append(int(token[row]))
        if not bool(live.any()) or step + 1 == room:
            break
        x = stem(token[:, None])
        exited = torch.zeros(len(prompts), dtype=torch.bool)
        hops = torch.zeros(len(prompts), dtype=torch.long)
        for position, (block, caches) in enumerate(zip(route.blocks, route.caches, strict=True)):
            computed = block(x, caches=caches)  # an exited row's keys/values come from its exit state
            x = torch.where(exited[:, None, None], x, computed)
            hops += (~exited).long()
            if min_blocks <= position + 1 < depth:
                confidence = torch.softmax(head(x[:, -1]).float(), dim=-1).amax(-1)
                exited |= confidence >= threshold
        logits = head(x[:, -1])
    return out
