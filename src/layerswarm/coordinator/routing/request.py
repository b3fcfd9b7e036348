"""What a classification request may ask for, checked before anything reaches a node.

A node refuses a hop it cannot serve (a position past the model's depth, activations with NaN or
Inf), and the coordinator counts a refusal against the node: so a request that would make every node
refuse must be refused here, as the caller's error, or any client could get healthy nodes ejected
(one request with `min_blocks` past the depth, or pixels of 1e30, did exactly that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from layerswarm.models.config import ViTConfig

from ..verification.ranges import hard_range_problem

if TYPE_CHECKING:
    from ..process import ClassifyOptions


class InvalidRequest(ValueError):
    """The request itself is wrong (HTTP 422 on the native API, 400 on KServe); the message says why."""


def check_options(opts: ClassifyOptions, config: ViTConfig) -> None:
    depth = config.depth
    if opts.min_blocks is not None and opts.min_blocks > depth:
        raise InvalidRequest(f"min_blocks {opts.min_blocks} is past the model's depth of {depth} blocks")
    if opts.min_blocks is not None and opts.max_blocks is not None and opts.min_blocks > opts.max_blocks:
        raise InvalidRequest(f"min_blocks {opts.min_blocks} is above max_blocks {opts.max_blocks}")


def check_images(images: torch.Tensor, config: ViTConfig) -> None:
    """Images are float pixels in [0, 1] (what every decoder here produces); a text family's token ids
    are checked where they are made (models/text/tokenizer.py)."""
    if config.is_text or not images.is_floating_point():
        return
    if not bool(torch.isfinite(images).all()):
        raise InvalidRequest("images contain NaN or infinite values")
    low, high = float(images.min()), float(images.max())
    if low < 0.0 or high > 1.0:
        raise InvalidRequest(
            f"image values must be in [0, 1], got [{low:.6g}, {high:.6g}] (8-bit pixels: divide by 255)"
        )


def check_stem_output(x: torch.Tensor, wire: torch.dtype) -> None:
    """Our own stem's output must be sendable: the first node would refuse it, and be blamed for it."""
    problem = hard_range_problem(x, 0, wire)  # NaN and Inf included: their peak fails the limit
    if problem is not None:
        raise InvalidRequest(f"this input makes activations no node can take ({problem['discrepancy']})")
