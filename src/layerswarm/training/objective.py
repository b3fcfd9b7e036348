"""What one training step computes, apart from the run around it (train.py): the block order of a batch
(LayerShuffle's random order, LayerDrop's kept blocks, or in order), the loss (label smoothing, mixup,
position heads, early exits), the augmentation, and the loss and accuracy over a held-out set."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from layerswarm.models.config import is_shuffle_robust
from layerswarm.models.vit import Block, ViT

from .data.datasets import Images, iterate_batches


def batch_order(model: ViT, variant: str, gen: torch.Generator, shuffle_chance: float = 1.0) -> list[int]:
    """The block order for one training batch: for a shuffle-robust variant a random order, or with
    probability 1 - shuffle_chance (during a shuffle ramp) the blocks in order."""
    depth = len(model.blocks)
    if is_shuffle_robust(variant):
        # Drawn only while ramping, so a run without a ramp draws exactly what it always drew.
        if shuffle_chance < 1.0 and float(torch.rand((), generator=gen)) >= shuffle_chance:
            return list(range(depth))
        return torch.randperm(depth, generator=gen).tolist()
    if variant == "layerdrop":
        keep = torch.rand(depth, generator=gen) >= model.cfg.layerdrop
        kept = [i for i in range(depth) if keep[i]]
        return kept or [int(torch.randint(depth, (1,), generator=gen))]
    return list(range(depth))


class Mix(NamedTuple):
    """A mixup batch's second set of targets: sample i is lam x image i + (1 - lam) x image perm[i], so its
    loss is lam x CE(label i) + (1 - lam) x CE(label perm[i])."""

    labels: Tensor  # labels[perm]
    lam: float


def mixup_batch(images: Tensor, labels: Tensor, alpha: float, gen: torch.Generator) -> tuple[Tensor, Mix]:
    """Blend a batch with a permutation of itself (mixup, Zhang et al. 2018): lam ~ Beta(alpha, alpha), one
    per batch. Every draw comes from the trainer's torch generator (a seed for numpy's Beta sampler, which
    torch cannot seed, then the permutation), so a run is reproducible from its seed and resumes with the
    generator state it already saves."""
    seed = int(torch.randint(2**62, (1,), generator=gen))
    lam = float(np.random.default_rng(seed).beta(alpha, alpha))
    perm = torch.randperm(images.shape[0], generator=gen)
    mixed = lam * images + (1 - lam) * images[perm.to(images.device)]
    return mixed, Mix(labels[perm.to(labels.device)], lam)


def label_loss(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0, mix: Mix | None = None) -> Tensor:
    """Cross-entropy against the labels; for a mixup batch, the lam-weighted pair of cross-entropies (the
    same label smoothing on both)."""
    loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
    if mix is None:
        return loss
    return mix.lam * loss + (1 - mix.lam) * F.cross_entropy(logits, mix.labels, label_smoothing=label_smoothing)


def training_loss(
    model: ViT,
    images: Tensor,
    labels: Tensor,
    order: list[int],
    exit_loss: float = 0.0,
    label_smoothing: float = 0.0,
    mix: Mix | None = None,
) -> Tensor:
    """Task cross-entropy (label-smoothed for images), plus each block's position cross-entropy for
    layershuffle-predict, plus (exit_loss > 0) the mean cross-entropy of the shared head read after every
    truncation depth. With `mix` (a mixup batch), every cross-entropy against the labels, the early exits'
    too, is the lam-weighted pair: a mixed image is lam parts one sample and 1 - lam parts another at every
    depth, not only at the last. The position loss stays as it is: a block's position in the order does not
    depend on what the image shows."""
    own_loss = getattr(model, "training_loss", None)  # text: the encoder masks its padding itself
    if own_loss is not None:
        if mix is not None:
            raise ValueError("mixup is for images: text batches are token ids, which do not blend")
        return own_loss(images, labels, order, exit_loss)
    x = model.stem(images)
    position_loss = images.new_zeros(())
    early: list[Tensor] = []
    for position, index in enumerate(order):
        block: Block = model.blocks[index]  # type: ignore[assignment]
        x = block(x, position)
        if block.position_head is not None:
            target = torch.full((x.shape[0],), position, dtype=torch.long, device=x.device)
            position_loss = position_loss + F.cross_entropy(block.position_logits(x), target)
        if exit_loss > 0 and position + 1 < len(order):
            early.append(label_loss(model.head(x), labels, mix=mix))
    loss = label_loss(model.head(x), labels, label_smoothing, mix) + position_loss
    if early:
        loss = loss + exit_loss * torch.stack(early).mean()
    return loss


SHIFT = 2  # pixels an augmented image may move each way


def augment(images: Tensor, gen: torch.Generator, hflip: bool) -> Tensor:
    """Small translations, each image its own (and mirror flips where asked for): cheap, and they keep
    tiny models from memorising. The border is zero-padded, not wrapped: wrapping would carry an object
    across the image and could change a spatial relation. Flips are off by default: they silently change
    the label of digits, text and relations."""
    if hflip:
        flip = torch.rand(images.shape[0], generator=gen) < 0.5
        images = torch.where(flip[:, None, None, None], images.flip(-1), images)
    return random_translate(images, gen, SHIFT)


def random_translate(images: Tensor, gen: torch.Generator, shift: int) -> Tensor:
    """Each image moved by its own (dy, dx) in [-shift, shift], zeros shifted in: a batched random crop."""
    b, c, h, w = images.shape
    padded = F.pad(images, (shift, shift, shift, shift))  # (B, C, H + 2s, W + 2s)
    dy, dx = torch.randint(0, 2 * shift + 1, (2, b), generator=gen)
    rows = (dy[:, None] + torch.arange(h))[:, None, :, None]  # (B, 1, H, 1)
    cols = (dx[:, None] + torch.arange(w))[:, None, None, :]  # (B, 1, 1, W)
    return padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]


@torch.no_grad()
@torch.no_grad()
def evaluate_objective(
    model: ViT, x: Images, y: Tensor, orders: list[list[int]], exit_loss: float, batch_size: int = 256, workers: int = 0
) -> float:
    """The training objective without its regularisers (no label smoothing, mixup or augmentation), mean over
    (x, y) and `orders`: the last block's cross-entropy plus `exit_loss` times the mean of the head's after
    every truncation depth. What an exit-aware run keeps its weights by."""
    model.eval()
    device = next(model.parameters()).device
    chunks = [torch.arange(i, min(i + batch_size, len(y))) for i in range(0, len(y), batch_size)]
    total = 0.0
    for idx, images in zip(chunks, iterate_batches(x, chunks, workers), strict=True):
        for order in orders:
            loss = training_loss(model, images.to(device), y[idx].to(device), order, exit_loss)
            total += float(loss) * len(idx)
    return total / (len(y) * len(orders))


def evaluate_loss(
    model: ViT,
    x: Images,
    y: Tensor,
    batch_size: int = 256,
    order: list[int] | None = None,
    workers: int = 0,
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over (x, y), in batches (x may be streamed from disk)."""
    model.eval()
    device = next(model.parameters()).device
    total_loss, correct = 0.0, 0
    chunks = [torch.arange(i, min(i + batch_size, len(y))) for i in range(0, len(y), batch_size)]
    for idx, images in zip(chunks, iterate_batches(x, chunks, workers), strict=True):
        logits = model(images.to(device), order)
        labels = y[idx].to(device)
        total_loss += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += int((logits.argmax(-1) == labels).sum())
    return total_loss / len(y), correct / len(y)
