"""The answer's decisive hops: where the predicted class distribution moved most.

A lie that changes an answer has to move the prediction, and does it at its own hop. The head (norm and
classifier, the coordinator's own) is cheap on the path's activations, so after the last hop the
coordinator reads the prediction after every hop and ranks the hops by how far each moved it: the
Kullback-Leibler divergence of the distribution after the hop from the one before it, summed over
the request's images. The executor re-executes the top `count` before the answer is returned.

The KL, not the gain of the final class: a pushed hop moves every image toward its class, and later
honest hops carry the push on, so the final class's gain is often larger after the lie than at it.
How often the lying hop comes first: bench/verify_sim.py, in docs/trust-verification.md. The executor
runs it on star paths (routing/executor.py); relay chains do not rank their hops yet.
"""

from __future__ import annotations

import torch


def movement(log_probs: torch.Tensor) -> torch.Tensor:
    """(H + 1, B, C) log-probabilities before the first hop and after each -> (H,) how far each hop moved
    the prediction: KL(after || before), summed over the batch."""
    after, before = log_probs[1:], log_probs[:-1]
    return (after.exp() * (after - before)).sum(dim=-1).sum(dim=-1)


def decisive_hops(log_probs: torch.Tensor, count: int) -> list[int]:
    """The indices (0: the first hop) of the `count` hops that moved the prediction most, most first."""
    moved = movement(log_probs)
    return moved.topk(min(count, moved.numel())).indices.tolist()
