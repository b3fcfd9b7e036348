"""A language model's training recipe: every default stated once, saved in the manifest with the weights
(torch-free, so the CLI can show the defaults in --help without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass

from layerswarm.models.lm.config import LM_VARIANTS


@dataclass
class LMRecipe:
    variant: str = "layershuffle"
    # Seconds of the whole run at most (validation included); the cosine ends there. Measured on budget_clock:
    # "wall" (the wall clock) or "cpu" (this process's CPU time: what the run would take alone on the cores
    # it uses, whatever else shares the machine; the shipped family was trained so on a shared machine).
    time_budget_s: float = 300.0
    budget_clock: str = "wall"
    max_steps: int = 100_000  # optimizer steps at most (the time budget usually ends a run first)
    # Tokens per step (padding included): each step draws its rows from one source, as many as fit, so a
    # step of short task rows costs about what a step of long text rows does.
    batch_tokens: int = 1536
    text_len: int = 64  # tokens per row of real text, <s> included
    # With tasks and text: the share of steps that draw text rows (the rest draw task rows).
    text_share: float = 0.5
    lr: float = 3e-3  # AdamW; tiny models train fast at rates nanoGPT uses for its smallest
    min_lr_share: float = 0.1  # the cosine ends at this share of lr
    warmup_steps: int = 100
    weight_decay: float = 0.1  # on weight matrices only (not norms, not biases)
    grad_clip: float = 1.0
    val_every: int = 250  # steps between validations (the weights with the lowest validation loss are kept)
    seed: int = 0
    # Variant layershuffle from scratch: over this share of the planned steps the chance that a batch runs
    # its blocks in a random order rises from 0 to 1 (in order before). 0: shuffled from the first step.
    shuffle_ramp: float = 0.0
    # Exit-aware training (LayerSkip, issue 41): the weight of the shared head's cross-entropy after every
    # shallower depth of the batch's route (0: off), so the first d blocks + the head make a usable draft ...
    exit_loss: float = 0.0
    # ... and per-sample layer dropout rising linearly with the position in the route, from 0 at the first
    # block to this rate at the last (0: off), so the later blocks learn to refine, not to rescue.
    exit_dropout: float = 0.0
    threads: int = 0  # torch CPU threads (0: torch's default)

    def __post_init__(self) -> None:
        if self.variant not in LM_VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r} for a language model; choose one of {LM_VARIANTS}")
        if self.time_budget_s <= 0 or self.max_steps < 1 or self.batch_tokens < 1 or self.val_every < 1:
            raise ValueError("time budget, steps, batch tokens and validation interval must be positive")
        if self.lr <= 0 or not 0 <= self.min_lr_share <= 1 or self.text_len < 2:
            raise ValueError("lr must be positive, min_lr_share in [0, 1], text_len at least 2")
        if not 0 < self.text_share < 1:
            raise ValueError(f"text_share must be in (0, 1), got {self.text_share}")
        if self.budget_clock not in ("wall", "cpu"):
            raise ValueError(f"budget_clock is wall or cpu, got {self.budget_clock!r}")
        if not 0 <= self.shuffle_ramp <= 1 or not 0 <= self.exit_dropout < 1 or self.exit_loss < 0:
            raise ValueError("shuffle_ramp in [0, 1], exit_dropout in [0, 1), exit_loss at least 0")
