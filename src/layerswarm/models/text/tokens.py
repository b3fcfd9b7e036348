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

PAD_CODE, FROZEN_CODE, ACTIVE_CODE = 0.0, 1.0, 2.0


def hop_mask(key_mask: Tensor, token_depth: Tensor | None, hops_run: int) -> Tensor:
    """The mask for the next hop: real tokens whose depth exceeds the hops already run are active
    (no depths: every real token is). Depth counts hops run, whatever blocks they were."""
    active = key_mask if token_depth is None else key_mask & (token_depth > hops_run)
    codes = torch.where(key_mask, FROZEN_CODE, PAD_CODE)
    return torch.where(active, ACTIVE_CODE, codes).to(torch.float32)


def mask_problem(mask: Tensor, x: Tensor) -> str | None:
    """Why `mask` cannot go with activations `x`, or None."""
    if mask.dim() != 2 or tuple(mask.shape) != tuple(x.shape[:2]):
        return f"token_mask shape {tuple(mask.shape)} does not match activations (B, T) = {tuple(x.shape[:2])}"
    if not bool(((mask == PAD_CODE) | (mask == FROZEN_CODE) | (mask == ACTIVE_CODE)).all()):
        return "token_mask values must be 0 (padding), 1 (frozen) or 2 (active)"
    if not bool((mask > PAD_CODE).any(dim=1).all()):
        return "token_mask leaves a sequence with no real token"
    return None


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


def split_problem(mask: Tensor, active: Tensor, frozen: Tensor) -> str | None:
    """Why the split form's parts cannot go with `mask`, or None."""
    n_active, n_frozen = active_count(mask), int((mask == FROZEN_CODE).sum())
    if active.shape[0] != n_active or frozen.shape[0] != n_frozen:
        return (
            f"split form: token_mask has {n_active} active and {n_frozen} frozen tokens, "
            f"activations has {active.shape[0]} rows and frozen {frozen.shape[0]}"
        )
    return None


def scatter_active(x: Tensor, mask: Tensor, updates: Tensor) -> Tensor:
    """x with the active tokens' states replaced by `updates` ((N_active, D), row-major)."""
    out = x.clone()
    out[mask == ACTIVE_CODE] = updates.to(out.dtype)
    return out
