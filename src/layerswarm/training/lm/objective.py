"""What one training step of a decoder computes: the block route and the next-token loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from layerswarm.models.config import is_shuffle_robust
from layerswarm.models.lm.model import DecoderLM

from .data import TokenRows


def batch_order(
    depth: int, variant: str, layerdrop: float, gen: torch.Generator, shuffle_chance: float = 1.0
) -> list[int]:
    """The blocks' order for one batch: a fresh random permutation (LayerShuffle; in order with probability
    1 - shuffle_chance during a ramp), some blocks left out (LayerDrop), or in order (baseline)."""
    if is_shuffle_robust(variant):
        if shuffle_chance < 1.0 and float(torch.rand((), generator=gen)) >= shuffle_chance:
            return list(range(depth))
        return torch.randperm(depth, generator=gen).tolist()
    if variant == "layerdrop":
        keep = torch.rand(depth, generator=gen) >= layerdrop
        kept = [i for i in range(depth) if keep[i]]
        return kept or [int(torch.randint(depth, (1,), generator=gen))]
    return list(range(depth))


def next_token_loss(
    model: DecoderLM,
    rows: TokenRows,
    order: list[int],
    exit_loss: float = 0.0,
    exit_dropout: float = 0.0,
    gen: torch.Generator | None = None,
) -> Tensor:
    """Mean cross-entropy of the target tokens after the route; with exit_loss, plus that weight times the
    mean cross-entropy of the shared head read after every shallower depth; with exit_dropout (training),
    each sample skips the block at position p with probability exit_dropout x p / (len(order) - 1)."""
    inputs, targets, mask = rows.ids[:, :-1], rows.ids[:, 1:], rows.loss[:, 1:]
    wanted = targets[mask]  # (M,): only target positions go through the head (a task's answer, or all text)
    x = model.stem(inputs)  # (B, T, D)
    early: list[Tensor] = []
    last = len(order) - 1
    for position, index in enumerate(order):
        out = model.blocks[index](x)
        if exit_dropout and model.training and position:
            rate = exit_dropout * position / last
            keep = torch.rand(x.shape[0], generator=gen) >= rate
            out = torch.where(keep.to(x.device)[:, None, None], out, x)
        x = out
        if exit_loss and position < last:
            early.append(F.cross_entropy(model.head(x[mask]), wanted))
    loss = F.cross_entropy(model.head(x[mask]), wanted)
    if early:
        loss = loss + exit_loss * torch.stack(early).mean()
    return loss


@torch.no_grad()
def rows_nll(model: DecoderLM, rows: TokenRows, order: list[int] | None = None, batch: int = 256) -> tuple[float, int]:
    """Summed negative log-likelihood of every target token of `rows` through `order`, and their count."""
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        part = rows.subset(torch.arange(i, min(i + batch, len(rows))))
        logits = model(part.ids[:, :-1], order)
        mask = part.loss[:, 1:]
        total += float(F.cross_entropy(logits[mask], part.ids[:, 1:][mask], reduction="sum"))
        count += int(mask.sum())
    return total, count
