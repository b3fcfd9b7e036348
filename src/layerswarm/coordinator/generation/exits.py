"""Per-token early exit through the swarm (CALM, Schuster et al. 2022; the monolith's own is
models/lm/early_exit.py): lossy, off unless asked for.

    resolve(options, default, calibrated)  the stream's rule: the request's `early_exit`, else the server's
                                           --early-exit; "on" takes the threshold `layerswarm eval`
                                           calibrated (the model's policy, key early_exit)
    ExitCheck.leaves(hops, rest, x)        after a hop of a plain decode step (one token): the head reads
                                           the state here; the token leaves the route when its top
                                           probability reaches the threshold and min_blocks ran
    skip_rest(s, rest, row, x)             the exit state becomes the input of every later block for that
                                           token: logged in their RowLogs, not sent. Their next Decode
                                           carries it as `fill` (runner.py: rows the node lacks before the
                                           new token's), so their caches stay complete at no extra trip, and
                                           a rebuild elsewhere replays it with the rest

Prefills, speculative verifies and a rewind's replays (more than one token) never exit: every token the
route runs after the prompt is a plain step's single one. Speculation and early exit are exclusive per
stream (a verify's drafts would each need an exit of their own): asked for both, the request is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch

from layerswarm.models import policy
from layerswarm.models.checkpoint import Manifest
from layerswarm.models.lm.config import LMConfig

from .options import NO_EXIT, EarlyExit, GenerationOptions, InvalidGeneration, Speculation
from .rows import RowLog

EXIT_POLICY = "early_exit"  # the policy key `layerswarm eval` writes (training/lm/commands.py)
Confidence = Callable[[torch.Tensor], Awaitable[float]]  # (1, 1, D) state -> the head's top probability


@dataclass(frozen=True)
class Calibrated:
    """What the model's evaluation chose: the threshold (None: none kept exact match within the loss) and
    the fewest blocks a token runs before it may leave."""

    threshold: float | None
    min_blocks: int


def calibrated(manifest: Manifest[LMConfig]) -> Calibrated:
    found = policy.entry(manifest, EXIT_POLICY) or {}
    threshold, min_blocks = found.get("threshold"), found.get("min_blocks")
    ok = isinstance(threshold, (int, float)) and 0 < threshold <= 1
    blocks = min_blocks if isinstance(min_blocks, int) and 1 <= min_blocks <= manifest.config.depth else 1
    return Calibrated(float(threshold) if ok else None, blocks)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ExitRule:
    threshold: float
    min_blocks: int


def resolve(
    options: GenerationOptions, default: EarlyExit, default_speculation: Speculation, model: Calibrated
) -> tuple[GenerationOptions, ExitRule | None]:
    """The options with both modes settled (a request's own choice wins over the server's default of the
    other mode), and the stream's exit rule. Raises InvalidGeneration naming `early_exit`."""
    ask = options.early_exit if options.early_exit is not None else default
    speculation = options.speculation if options.speculation is not None else default_speculation
    if ask.on and speculation.on:
        if options.early_exit is not None and options.speculation is not None:
            raise InvalidGeneration(
                "early_exit and speculation cannot both be on in one request: pick one", "early_exit", "conflict"
            )
        if options.early_exit is None:  # the request asked for speculation: the server's exit default yields
            ask = NO_EXIT
        else:
            speculation = Speculation()
    options = dataclasses.replace(options, early_exit=ask, speculation=speculation)
    if not ask.on:
        return options, None
    threshold = ask.threshold if ask.threshold is not None else model.threshold
    if threshold is None:
        raise InvalidGeneration(
            'early_exit "on" needs the threshold `layerswarm eval` calibrates, and this model has none: '
            "give a threshold over 0 and at most 1",
            "early_exit",
            "not_calibrated",
        )
    return options, ExitRule(threshold, model.min_blocks)


@dataclass
class ExitStats:
    """A stream's block-hops: nodes called, over every pass of the route, and the tokens that left early."""

    rule: ExitRule | None = None
    block_hops: int = 0
    exits: int = 0


class ExitView(TypedDict):
    mode: str  # off | the threshold used
    min_blocks: int | None
    exits: int  # tokens that left the route before its last block
    block_hops: int  # Decode calls over the stream's passes (the prefill's included)
    block_hops_per_token: float | None  # over the generated tokens (plain decoding: the route's depth)


def exit_view(stats: ExitStats, generated: int) -> ExitView:
    rule = stats.rule
    return {
        "mode": "off" if rule is None else str(rule.threshold),
        "min_blocks": None if rule is None else rule.min_blocks,
        "exits": stats.exits,
        "block_hops": stats.block_hops,
        "block_hops_per_token": round(stats.block_hops / generated, 4) if generated else None,
    }


class ExitCheck:
    """One stream's rule with the coordinator's head: whether the newest token leaves after this hop."""

    def __init__(self, rule: ExitRule, confidence: Confidence) -> None:
        self.rule = rule
        self.confidence = confidence

    async def leaves(self, hops: int, rest: int, x: torch.Tensor) -> bool:
        """hops: blocks this token ran; rest: blocks still ahead of it; x (1, T, D) the state now."""
        if x.shape[1] != 1 or rest == 0 or hops < self.rule.min_blocks:
            return False
        return await self.confidence(x[:, -1]) >= self.rule.threshold


def skip_rest(inputs: Sequence[RowLog], row: int, x: torch.Tensor) -> None:
    """The exit state x (1, 1, D) as token `row`'s input to each skipped block (sent as `fill` later)."""
    for log in inputs:
        log.put(row, x)


def top_probability(head: torch.nn.Module, x: torch.Tensor) -> float:
    """x (1, D): the head's most likely token's probability (as the monolith's early exit reads it)."""
    return float(torch.softmax(head(x).float(), dim=-1).amax())
