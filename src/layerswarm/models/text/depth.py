"""Per-token depth as served: the policy key a model directory keeps its tables under, and the depth of
each token of a request looked up in them (the coordinator's text route; `layerswarm depth` estimates
the tables, training/text/depth.py).

Each table maps a token id to the number of hops the token runs before it freezes; [CLS] always gets
the full depth (the head reads it), padding 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .model import key_mask_of

DEPTH_POLICY = "token_depth"
ESTIMATES = ("mi", "reconstruction")


def token_depths(policy: object, estimate: str, ids: Tensor) -> Tensor:
    """(B, T) hops per token for `ids` from a model's depth policy, padding 0. [CLS] is a token like
    the others: both estimates give it the full depth. Raises ValueError when the model has no such table."""
    if estimate not in ESTIMATES:
        raise ValueError(f"unknown token depth estimate {estimate!r}: choose one of {', '.join(ESTIMATES)}")
    if not isinstance(policy, dict) or not isinstance(policy.get(estimate), list):
        raise ValueError(f"this model has no {estimate} token depths: run `layerswarm depth MODEL_DIR`")
    table = torch.tensor(policy[estimate], dtype=torch.long)
    if int(ids.max()) >= len(table):
        raise ValueError("the depth table is shorter than the vocabulary")
    depth = table[ids]
    real = key_mask_of(ids)
    return torch.where(real, depth, torch.zeros_like(depth))
