"""Whether a reply still looks like its block's work on its input: a change of behaviour, seen for free.

A transformer block is residual: its output is its input plus a correction, so output and input tokens
point the same way (mean cosine 0.57 to 0.99 over the shipped family's blocks, noise and flat images
included) and the correction is a bounded share of the input. A node that sends noise with the real
mean and std, zeros, or any output not computed from this input breaks that at once (cosine about 0),
where the range filter (ranges.py), which looks at the output alone, cannot see it. So:

- a mean cosine below COS_FLOOR is suspicious from the first hop (no learning needed);
- once BAND_SAMPLES hops of a block index have passed re-execution, a hop of that index whose cosine is
  COS_MARGIN below, or whose correction is RATIO_SLACK times above, everything those checks saw is too.

Suspicion only forces re-execution (sampling.py): it never convicts, so an odd honest input costs one
check. The bands learn only from hops whose re-execution passed: a liar cannot widen them with its lies.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

COS_FLOOR = 0.25
COS_MARGIN = 0.1
RATIO_SLACK = 1.5
BAND_SAMPLES = 16
BAND_KEEP = 512  # per block index, the most recent passed hops' features


@dataclass(frozen=True)
class Residual:
    """A hop's fit to "input plus a correction": the smallest per-image mean cosine between output and
    input tokens, and the largest per-image RMS of (output - input) over RMS of the input."""

    cosine: float
    ratio: float


def residual(x: torch.Tensor, out: torch.Tensor) -> Residual:
    """x, out: (B, T, D) the hop's input and the node's reply to it."""
    x, out = x.float(), out.float()
    cosine = F.cosine_similarity(out, x, dim=-1).mean(dim=1)  # (B,)
    ratio = (out - x).pow(2).mean(dim=(1, 2)).sqrt() / x.pow(2).mean(dim=(1, 2)).sqrt().clamp_min(1e-6)
    return Residual(float(cosine.min()), float(ratio.max()))


@dataclass
class ResidualBands:
    """What passed re-execution looked like, per block index (blocks of one index in a family are alike)."""

    cosines: dict[int, deque[float]] = field(default_factory=dict)
    ratios: dict[int, deque[float]] = field(default_factory=dict)

    def learn(self, block: int, fit: Residual) -> None:
        self.cosines.setdefault(block, deque(maxlen=BAND_KEEP)).append(fit.cosine)
        self.ratios.setdefault(block, deque(maxlen=BAND_KEEP)).append(fit.ratio)

    def problem(self, block: int, fit: Residual) -> str | None:
        """Why this hop does not look like its block's work (None: it does)."""
        if fit.cosine < COS_FLOOR:
            return f"output not residual-like: mean token cosine with its input {fit.cosine:.3f} < {COS_FLOOR}"
        seen = self.cosines.get(block)
        if seen is None or len(seen) < BAND_SAMPLES:
            return None
        low, high = min(seen) - COS_MARGIN, max(self.ratios[block]) * RATIO_SLACK
        if fit.cosine < low:
            return f"mean token cosine with its input {fit.cosine:.3f}, below block {block}'s checked hops ({low:.3f})"
        if fit.ratio > high:
            return f"correction {fit.ratio:.3f} of its input, above block {block}'s checked hops ({high:.3f})"
        return None
