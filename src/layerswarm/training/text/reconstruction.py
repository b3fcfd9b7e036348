"""The reconstruction-loss depth estimate (Liu et al., "Faster Depth-Adaptive Transformers", eq. 4).

1. An *anytime* masked LM: a copy of the model's encoder, fine-tuned to predict a [MASK]ed word after
   EVERY block with one shared classifier (LayerNorm + linear over the vocabulary), the per-layer losses
   summed with equal weights (the paper's setup, minus next-sentence prediction). Labels are never read.
2. Every word of up to `max_sentences` training sentences is masked in turn; loss_n is its loss after n
   blocks, averaged per word; its depth is argmin_n(loss_n + lambda n), lambda 0.1, n = 1..N.

The sign: the paper prints `loss_n - lambda n` but calls lambda n "the penalty factor to encourage a lower
selection", and its Table 4 has the average depth FALL as lambda grows (9.5 at 0, 4.5 at 0.1, 3.6 at
0.2). Only `+ lambda n` does either; `- lambda n` rewards depth (and with a loss that falls with n it can
never pick a shallower layer than lambda 0 does). So a word is sent deeper only while each further block
lowers its reconstruction loss by more than lambda nats: words the context cannot predict better with
depth (random fillers) stop at 1, words the context does predict better with depth go deep.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from layerswarm.models.text.model import key_mask_of
from layerswarm.models.text.tokenizer import CLS_ID, MASK_ID, PAD_ID
from layerswarm.models.vit import ViT

LAMBDA = 0.1
log = logging.getLogger(__name__)


class AnytimeMLM(nn.Module):
    """The encoder's stem and blocks plus one shared vocabulary classifier read after every block."""

    def __init__(self, model: ViT) -> None:
        super().__init__()
        self.stem = copy.deepcopy(model.stem)
        self.blocks = copy.deepcopy(model.blocks)
        dim, vocab = model.cfg.dim, model.cfg.vocab_size
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, vocab)

    def layer_logits(self, ids: Tensor, rows: Tensor, cols: Tensor) -> list[Tensor]:
        """(len(rows), V) vocabulary logits at positions (rows, cols) after each block, in order."""
        x, mask = self.stem(ids), key_mask_of(ids)
        out = []
        for n, block in enumerate(self.blocks):
            x = block(x, n, mask)
            out.append(self.classifier(self.norm(x[rows, cols])))
        return out


def _mask_one_word(ids: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One random word ([CLS] and padding excluded) per sentence replaced by [MASK]."""
    words = (ids != PAD_ID) & (ids != CLS_ID)
    scores = torch.rand(ids.shape, generator=generator).masked_fill(~words, -1.0)
    cols = scores.argmax(dim=1)
    rows = torch.arange(len(ids))
    targets = ids[rows, cols]
    masked = ids.clone()
    masked[rows, cols] = MASK_ID
    return masked, rows, cols, targets


def train_anytime_mlm(model: ViT, ids: Tensor, steps: int = 600, batch: int = 128, seed: int = 0) -> AnytimeMLM:
    """Fine-tune the anytime masked LM on unlabelled sentences `ids` (summed per-layer losses)."""
    mlm = AnytimeMLM(model)
    usable = ids[((ids != PAD_ID) & (ids != CLS_ID)).any(dim=1)]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(mlm.parameters(), lr=2e-3, weight_decay=0.01)
    mlm.train()
    for step in range(steps):
        picked = usable[torch.randint(len(usable), (batch,), generator=generator)]
        masked, rows, cols, targets = _mask_one_word(picked, generator)
        loss = torch.stack([F.cross_entropy(lg, targets) for lg in mlm.layer_logits(masked, rows, cols)]).sum()
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(mlm.parameters(), 5.0)
        optimizer.step()
        if step % 200 == 0 or step == steps - 1:
            log.info("anytime MLM step %d: summed loss %.3f", step, loss.item())
    mlm.eval()
    return mlm


@torch.inference_mode()
def word_layer_losses(mlm: AnytimeMLM, ids: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """((V, N) mean loss of each word masked in its sentences after n blocks, (V,) occurrences)."""
    depth_n = len(mlm.blocks)
    sums = torch.zeros(vocab_size, depth_n, dtype=torch.float64)
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for sentence in ids:
        length = int((sentence != PAD_ID).sum())
        cols = torch.arange(1, length)  # every word, not [CLS]
        if len(cols) == 0:
            continue
        masked = sentence[:length].repeat(len(cols), 1)
        rows = torch.arange(len(cols))
        masked[rows, cols] = MASK_ID
        targets = sentence[cols]
        for n, logits in enumerate(mlm.layer_logits(masked, rows, cols)):
            sums[targets, n] += F.cross_entropy(logits, targets, reduction="none").to(torch.float64)
        counts[targets] += 1.0
    return sums / counts.clamp_min(1.0)[:, None], counts


def depths_from_losses(losses: Tensor, counts: Tensor, lam: float = LAMBDA) -> list[int]:
    """Depth 1..N per word: argmin_n(loss_n + lam n); unseen words and specials get the full depth."""
    depth_n = losses.shape[1]
    penalty = lam * torch.arange(1, depth_n + 1, dtype=torch.float64)
    chosen = (losses.to(torch.float64) + penalty).argmin(dim=1) + 1
    chosen[counts == 0] = depth_n
    chosen[[PAD_ID, CLS_ID]] = depth_n
    return [int(d) for d in chosen]


def reconstruction_depths(
    model: ViT, ids: Tensor, max_sentences: int = 1000, lam: float = LAMBDA, steps: int = 600, seed: int = 0
) -> tuple[list[int], dict[str, list[float]]]:
    """Depth per token id from an anytime MLM fine-tuned on `ids`, and the mean per-layer losses of the
    words (by token id, for the report)."""
    torch.manual_seed(seed)
    mlm = train_anytime_mlm(model, ids, steps=steps, seed=seed)
    losses, counts = word_layer_losses(mlm, ids[:max_sentences], model.cfg.vocab_size)
    seen = {str(i): [round(float(v), 3) for v in losses[i]] for i in range(len(counts)) if counts[i] > 0}
    return depths_from_losses(losses, counts, lam), seen
