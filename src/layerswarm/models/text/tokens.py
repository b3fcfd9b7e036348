"""Token masks on the wire: which tokens a hop computes, which it only reads, which are padding.

A hop's token mask is (B, T) float32 with one code per token:

    0  padding: never attended to, never computed
    1  frozen: the token reached its depth; it still serves as key and value, its state is unchanged
    2  active: the block computes this token's new state

A node computes queries and the MLP for active tokens only and replies with just their new states,
(N_active, D) in row-major (batch, token) order; the coordinator scatters them back. So compute and
reply bytes shrink as tokens freeze. The request still carries every real token (keys and values);
in the split form (`split_states`) frozen tokens travel apart in a compact dtype, since a hop only reads them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..vit import Block
from .codes import ACTIVE_CODE, FROZEN_CODE, PAD_CODE

__all__ = ["ACTIVE_CODE", "FROZEN_CODE", "PAD_CODE"]


def hop_mask(key_mask: Tensor, token_depth: Tensor | None, hops_run: int) -> Tensor:
    """The mask for the next hop: real tokens whose depth exceeds the hops already run are active
    (no depths: every real token is). Depth counts hops run, whatever blocks they were."""
    active = key_mask if token_depth is None else key_mask & (token_depth > hops_run)
    codes = torch.where(key_mask, FROZEN_CODE, PAD_CODE)
    return torch.where(active, ACTIVE_CODE, codes).to(torch.float32)


def active_count(mask: Tensor) -> int:
    return int((mask == ACTIVE_CODE).sum())


@torch.inference_mode()
def run_active(block: Block, x: Tensor, position: int, mask: Tensor) -> Tensor:
    """The block's new states for the active tokens only: (N_active, D), row-major."""
    keys, active = mask > PAD_CODE, mask == ACTIVE_CODE
    counts = active.sum(dim=1)
    width = int(counts.max()) if counts.numel() else 0
    if width == 0:
        return x.new_zeros((0, x.shape[-1]))
    # active token indices first, in token order (a stable sort of "not active")
    rows = torch.argsort((~active).to(torch.int8), dim=1, stable=True)[:, :width]
    valid = torch.arange(width)[None, :] < counts[:, None]
    return block.forward_active(x, position, keys, rows)[valid]


def split_states(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(active tokens' states (N_active, D), frozen tokens' states (N_frozen, D)), row-major: the
    split form of a text hop, where each part can travel in its own dtype (padding is not sent)."""
    return x[mask == ACTIVE_CODE], x[mask == FROZEN_CODE]


def join_states(mask: Tensor, active: Tensor, frozen: Tensor) -> Tensor:
    """The (B, T, D) activations `split_states` came from (padding rows zero; float32). The caller
    checks the row counts against the mask (`split_problem`)."""
    x = active.new_zeros((*mask.shape, active.shape[-1]), dtype=torch.float32)
    x[mask == ACTIVE_CODE] = active.to(torch.float32)
    x[mask == FROZEN_CODE] = frozen.to(torch.float32)
    return x


def scatter_active(x: Tensor, mask: Tensor, updates: Tensor) -> Tensor:
    """x with the active tokens' states replaced by `updates` ((N_active, D), row-major)."""
    out = x.clone()
    out[mask == ACTIVE_CODE] = updates.to(out.dtype)
    return out
