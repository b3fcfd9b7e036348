"""Token mask codes and the checks on them, in numpy: what a node (any engine) applies to a text hop.

A hop's token mask is (B, T) float32 with one code per token (models/text/tokens.py has the torch side
the coordinator uses): 0 padding, 1 frozen (read as key and value only), 2 active (computed).
"""

from __future__ import annotations

import numpy as np

PAD_CODE, FROZEN_CODE, ACTIVE_CODE = 0.0, 1.0, 2.0


def mask_problem(mask: np.ndarray, x: np.ndarray) -> str | None:
    """Why `mask` cannot go with activations `x`, or None."""
    if mask.ndim != 2 or tuple(mask.shape) != tuple(x.shape[:2]):
        return f"token_mask shape {tuple(mask.shape)} does not match activations (B, T) = {tuple(x.shape[:2])}"
    if not bool(((mask == PAD_CODE) | (mask == FROZEN_CODE) | (mask == ACTIVE_CODE)).all()):
        return "token_mask values must be 0 (padding), 1 (frozen) or 2 (active)"
    if not bool((mask > PAD_CODE).any(axis=1).all()):
        return "token_mask leaves a sequence with no real token"
    return None


def split_problem(mask: np.ndarray, active: np.ndarray, frozen: np.ndarray) -> str | None:
    """Why the split form's parts cannot go with `mask`, or None."""
    n_active, n_frozen = int((mask == ACTIVE_CODE).sum()), int((mask == FROZEN_CODE).sum())
    if active.shape[0] != n_active or frozen.shape[0] != n_frozen:
        return (
            f"split form: token_mask has {n_active} active and {n_frozen} frozen tokens, "
            f"activations has {active.shape[0]} rows and frozen {frozen.shape[0]}"
        )
    return None


def join_states(mask: np.ndarray, active: np.ndarray, frozen: np.ndarray) -> np.ndarray:
    """The (B, T, D) float32 activations the split form came from (padding rows zero). The caller checks
    the row counts against the mask (`split_problem`)."""
    x = np.zeros((*mask.shape, active.shape[-1]), dtype=np.float32)
    x[mask == ACTIVE_CODE] = active.astype(np.float32, copy=False)
    x[mask == FROZEN_CODE] = frozen.astype(np.float32, copy=False)
    return x


def active_rows(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows (B, A): each sequence's active token indices first, in token order, padded with others;
    valid (B, A): which of them are active). A is the most active tokens of any sequence."""
    active = mask == ACTIVE_CODE
    counts = active.sum(axis=1)
    width = int(counts.max()) if counts.size else 0
    rows = np.argsort(~active, axis=1, kind="stable")[:, :width]  # a stable sort of "not active"
    valid = np.arange(width)[None, :] < counts[:, None]
    return rows, valid
