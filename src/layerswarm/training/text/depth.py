"""Per-token depth estimated before inference (Liu et al., "Faster Depth-Adaptive Transformers").

- Mutual information: for each word x, MI(x) = sum over labels y and i_x, i_y in {0, 1} of
  P(i_x, i_y) log(P(i_x, i_y) / (P(i_x) P(i_y))) from sentence counts on the TRAINING set (smoothing
  0.1 per cell), scaled as -log MI(x), cut into N equal-width bins (N = the model's depth): the bin
  index (1..N) is the word's depth, so label-bearing words (high MI) get shallow depths.
  This is the paper's direction (eq. 3; "the larger MI(x, y) is ... fewer computations are needed"):
  words that say nothing about the label (MI near 0) get a large -log MI and so go DEEP.
- Reconstruction (reconstruction.py): an anytime masked LM, argmin_n(loss_n + lambda n), lambda 0.1.

Both tables (depth per token id) go into the model directory's policy under "token_depth". [CLS] is
looked up like any token and both give it the full depth N: MI(x) is 0 for a token in every sentence
(-log MI: the last bin), and [CLS] is never reconstructed. That matters: the head reads [CLS], so the
classifier always sees a full-depth [CLS] that read the frozen words (the paper pools over all states
at the deepest word's layer instead). An earlier rule here ran [CLS] only as deep as its deepest word,
which made "every word at depth 1" (the reconstruction estimate on `words`) classify from one block.
"""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor

from layerswarm.models.text.tokenizer import CLS_ID, PAD_ID

from .reconstruction import LAMBDA

SMOOTHING = 0.1


def mutual_information(ids: Tensor, labels: Tensor, vocab_size: int, num_classes: int) -> Tensor:
    """(V,) MI(x) of each token id's presence in a sentence with the labels (smoothed counts)."""
    n = float(len(labels))
    with_word = torch.zeros(vocab_size, num_classes, dtype=torch.float64)  # sentences with x and label y
    for start in range(0, len(labels), 2048):
        chunk = ids[start : start + 2048]
        present = torch.zeros(len(chunk), vocab_size, dtype=torch.float64).scatter_(1, chunk, 1.0)
        with_word += present.T @ F.one_hot(labels[start : start + 2048], num_classes).to(torch.float64)
    n_x = with_word.sum(1, keepdim=True)  # (V, 1)
    n_y = torch.bincount(labels, minlength=num_classes).to(torch.float64)[None, :]  # (1, C)
    cells = [with_word, n_x - with_word, n_y - with_word, n - n_x - n_y + with_word]  # (ix, iy) = 11 10 01 00
    total = n + 4 * SMOOTHING
    p = [(c + SMOOTHING) / total for c in cells]
    px1, py1 = p[0] + p[1], p[0] + p[2]
    marg = [(px1, py1), (px1, 1 - py1), (1 - px1, py1), (1 - px1, 1 - py1)]
    mi = sum(pc * torch.log(pc / (mx * my)) for pc, (mx, my) in zip(p, marg, strict=True))
    assert isinstance(mi, Tensor)
    return mi.sum(1).to(torch.float32)


def mi_depths(ids: Tensor, labels: Tensor, vocab_size: int, num_classes: int, bins: int) -> list[int]:
    """Depth 1..bins per token id from -log MI in equal-width bins over the words seen in training."""
    mi = mutual_information(ids, labels, vocab_size, num_classes)
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    seen[ids.flatten()] = True
    seen[[PAD_ID, CLS_ID]] = False
    scaled = -torch.log(mi.clamp_min(1e-12))
    lo, hi = float(scaled[seen].min()), float(scaled[seen].max())
    width = (hi - lo) / bins or 1.0
    depth = ((scaled - lo) / width).floor().clamp(0, bins - 1).to(torch.long) + 1
    depth[~seen] = bins  # never seen in training (and specials): no evidence, full depth
    return [int(d) for d in depth]


# A text model's `token_depth` policy entry (models/text/depth.py serves it): a depth per token id from
# each estimate, how they were made, and their mean over the vocabulary ("lambda" is a Python keyword:
# hence the functional form).
DepthTables = TypedDict(
    "DepthTables",
    {
        "bins": int,
        "smoothing": float,
        "lambda": float,
        "mi": list[int],
        "reconstruction": list[int],
        "mean_over_vocab": dict[str, float],
    },
)


def depth_policy(mi: list[int], reconstruction: list[int], depth: int) -> DepthTables:
    def mean(values: list[int]) -> float:
        return round(sum(values) / len(values), 3)

    return {
        "bins": depth,
        "smoothing": SMOOTHING,
        "lambda": LAMBDA,
        "mi": mi,
        "reconstruction": reconstruction,
        "mean_over_vocab": {"mi": mean(mi), "reconstruction": mean(reconstruction)},
    }
