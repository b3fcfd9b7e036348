"""Seeded held-out splits that leave every class something to train on."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def held_out_split(labels: torch.Tensor, n_held: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(held-out indices, training indices): the first n_held of a seeded permutation are held out, except
    that a class all of whose images were drawn into the held-out part gets its first one back (a folder
    with a class of one or two images among hundreds lost it to the split: a class never trained on, with
    no word). The split is the plain permutation's whenever every class keeps an image, and the held-out
    part keeps at least one image."""
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    held, kept = perm[:n_held], perm[n_held:]
    trained = set(labels[kept].tolist())
    give_back: list[int] = []
    for position, index in enumerate(held.tolist()):
        label = int(labels[index])
        if label not in trained and len(held) - len(give_back) > 1:
            trained.add(label)
            give_back.append(position)
    if give_back:
        mask = torch.ones(len(held), dtype=torch.bool)
        mask[give_back] = False
        kept = torch.cat([kept, held[~mask]])
        held = held[mask]
    untrained = sorted(set(labels.tolist()) - set(labels[kept].tolist()))
    if untrained:
        log.warning("class(es) %s have no image left to train on after the held-out split", untrained)
    return held, kept


def validation_split(
    labels: torch.Tensor, val_fraction: float, seed: int, split_seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(validation indices, training indices) of a training folder, as every run splits it: a share
    `val_fraction` (at least one image) held out by `split_seed`, or by the training seed without one.
    The trainer and anything that must see the same split (bench.reference_cnn) call this one rule."""
    n_val = max(1, int(len(labels) * val_fraction))
    return held_out_split(labels, n_val, seed if split_seed is None else split_seed)
