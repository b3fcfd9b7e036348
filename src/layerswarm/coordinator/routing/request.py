"""One request, from the HTTP layer to the executor: what the caller asked (ClassifyOptions), what the
router settled for it (Request), and what a request may ask for, checked before anything reaches a node.

A node refuses a hop it cannot serve (a position past the model's depth, activations with NaN or
Inf), and the coordinator counts a refusal against the node: so a request that would make every node
refuse must be refused here, as the caller's error, or any client could get healthy nodes ejected
(one request with `min_blocks` past the depth, or pixels of 1e30, did exactly that).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from layerswarm.models.config import ViTConfig

from ..verification.ranges import hard_range_problem
from .planner import Policy


@dataclass(frozen=True)
class ClassifyOptions:
    """What the caller asked: every API builds it from its own validated body by field name
    (`from_fields`), and the router and the executor read it as it is, never copied field by field."""

    top_k: int = 5
    policy: Policy | None = None  # None: the family's default
    seed: int | None = None
    min_blocks: int | None = None  # readiness: None: the coordinator's (depth.py)
    max_blocks: int | None = None
    exit_confidence: float | None = None  # early exit once the head is this sure (from the exit floor)
    exit_rule: str | None = None  # confidence | entropy | patience | none; None: the coordinator's default
    exit_threshold: float | None = None  # None: the calibrated threshold of the rule
    deadline_ms: float | None = None  # anytime: answer with what ran once the next hop would be late
    ensemble: int = 1  # routes whose logits are averaged
    ensemble_mode: str = "adaptive"  # adaptive: another route only while unsure; parallel: all at once
    ensemble_confidence: float | None = None  # adaptive: unsure below this; None: the calibrated value
    ensemble_over: str = "members"  # members: route i runs member i (stem, nodes, head); orders: one model
    repeats: bool | None = None  # None: where calibration showed repeated blocks help
    token_depth: torch.Tensor | None = None  # text: (B, T) hops per token before it freezes (None: all)

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> ClassifyOptions:
        """The options among `values` (a validated request body's fields), taken by name; a policy
        given by its name becomes a Policy. Fields that are not options (an image, a label) are left."""
        names = {f.name for f in dataclasses.fields(cls)}
        chosen = {name: value for name, value in values.items() if name in names}
        if isinstance(chosen.get("policy"), str):
            chosen["policy"] = Policy(chosen["policy"])
        return cls(**chosen)


@dataclass(frozen=True)
class Request:
    """One request as the router runs it: the caller's options (held, not copied), its inputs, and what
    the coordinator settled for it. Every route of the request reads the same one."""

    options: ClassifyOptions
    id: str  # in the nodes' logs: every hop and chain of the request carries it
    inputs: torch.Tensor  # (B, C, H, W) float32 images in [0, 1], or (B, T) token ids: for members' stems
    x: torch.Tensor  # our own stem's output
    policy: Policy  # the options' or the family's default
    seed: int  # the options' or a fresh random one (answered, so a path can be repeated)
    min_blocks: int  # readiness: a path that runs out below this depth fails (503; depth.py)
    anytime_min_blocks: int  # the caller's deadline cuts the path only from this depth on
    shuffle_robust: bool  # any unused block may stand in for a missing one (robust family, not sequential)
    deadline: float  # time.monotonic() by which the path must be done (--request-timeout)
    anytime_deadline: float | None  # the caller's budget: no hop starts past it once min depth ran
    key_mask: torch.Tensor | None = None  # text: (B, T) True for real tokens; hops carry a token mask


class InvalidRequest(ValueError):
    """The request itself is wrong (HTTP 422 on the native API, 400 on KServe); the message says why."""


def check_options(opts: ClassifyOptions, config: ViTConfig) -> None:
    """Options no node could serve: min_blocks past the depth or above max_blocks."""
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
