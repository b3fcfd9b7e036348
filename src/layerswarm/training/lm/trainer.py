"""The decoder's training loop: AdamW, warm-up then cosine to the time budget, a block route per batch
(objective.batch_order), validation every few hundred steps keeping the best weights, a progress bar.

Validation measures the loss in the order the model will be served in: the mean over a few fixed random
orders for LayerShuffle (the swarm routes it in any order), in order otherwise. The weights kept are the
ones with the lowest such loss (never during a shuffle ramp, when batches still run in order).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from layerswarm.models.config import is_shuffle_robust
from layerswarm.models.lm.model import DecoderLM

from .data import LMData, TokenRows
from .objective import batch_order, next_token_loss, rows_nll
from .recipe import LMRecipe

log = logging.getLogger(__name__)

VAL_ORDERS = 3  # fixed random orders behind a LayerShuffle model's validation loss
FIRST_PLAN = 20  # steps before the schedule is first fitted to the time budget
VAL_ROWS = 512  # rows per source validated at most (the loss of a few thousand targets is stable enough)


def param_groups(model: DecoderLM, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (and the embedding) only, as nanoGPT: norms and biases keep theirs."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class LMTrainer:
    def __init__(self, model: DecoderLM, data: LMData, recipe: LMRecipe) -> None:
        if not data.train:
            raise ValueError("no training data")
        self.model, self.data, self.recipe = model, data, recipe
        self.gen = torch.Generator().manual_seed(recipe.seed)
        self.opt = torch.optim.AdamW(param_groups(model, recipe.weight_decay), lr=recipe.lr, betas=(0.9, 0.95))
        depth = model.cfg.depth
        orders_gen = torch.Generator().manual_seed(recipe.seed + 1)
        self.val_orders = [torch.randperm(depth, generator=orders_gen).tolist() for _ in range(VAL_ORDERS)]
        self.val = [rows.subset(torch.arange(min(len(rows), VAL_ROWS))) for rows in data.val]
        self.planned = recipe.max_steps
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.best_loss = math.inf
        self.best_state: dict[str, torch.Tensor] | None = None
        self.clock = time.process_time if recipe.budget_clock == "cpu" else time.perf_counter
        self.started = self.wall_started = 0.0
        self.stopped = ""

    def lr_at(self, step: int) -> float:
        r = self.recipe
        if step < r.warmup_steps:
            return r.lr * (step + 1) / r.warmup_steps
        progress = min(1.0, (step - r.warmup_steps) / max(1, self.planned - r.warmup_steps))
        floor = r.lr * r.min_lr_share
        return floor + (r.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def shuffle_chance(self) -> float:
        ramp = self.recipe.shuffle_ramp
        return 1.0 if ramp == 0.0 else min(1.0, self.step / (ramp * self.planned))

    def elapsed(self) -> float:
        """Seconds spent on the budget's clock."""
        return self.clock() - self.started

    def _draw(self) -> TokenRows:
        """One batch of rows from one source: text with probability text_share when there are tasks too."""
        sources = self.data.train
        if len(sources) == 1:
            rows = sources[0]
        else:
            text = float(torch.rand((), generator=self.gen)) < self.recipe.text_share
            rows = next(r for r in sources if (r.source == "text") == text)
        count = max(1, self.recipe.batch_tokens // rows.ids.shape[1])
        index = torch.randint(len(rows), (count,), generator=self.gen)
        return rows.subset(index)

    def train_step(self) -> float:
        self.model.train()
        cfg, r = self.model.cfg, self.recipe
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step)
        order = batch_order(cfg.depth, r.variant, cfg.layerdrop, self.gen, self.shuffle_chance())
        loss = next_token_loss(self.model, self._draw(), order, r.exit_loss, r.exit_dropout, self.gen)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), r.grad_clip)
        self.opt.step()
        self.step += 1
        return float(loss.detach())

    def validate(self) -> dict[str, float]:
        """Mean validation loss per target token, in order and (LayerShuffle) over the fixed random orders."""
        self.model.eval()

        def loss(order: list[int] | None) -> float:
            sums = [rows_nll(self.model, rows, order) for rows in self.val]
            return statistics.fmean(total / max(1, count) for total, count in sums)

        record = {"val_loss": loss(None)}
        if is_shuffle_robust(self.recipe.variant):
            record["val_loss_arbitrary"] = statistics.fmean(loss(o) for o in self.val_orders)
        return record

    def served_loss(self, record: dict[str, float]) -> float:
        return record.get("val_loss_arbitrary", record["val_loss"])

    def fit(self, on_record: Callable[[dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        r = self.recipe
        self.started, self.wall_started = self.clock(), time.perf_counter()
        bar = tqdm(total=self.planned, desc="training", unit="step", disable=None, dynamic_ncols=True)
        running: list[float] = []
        while True:
            running.append(self.train_step())
            bar.update(1)
            if self.step == FIRST_PLAN:  # a first pace, so the warm-up hands over to a cosine of the right length
                self._plan()
                bar.total = self.planned
            out_of_time = self.elapsed() >= r.time_budget_s
            done = out_of_time or self.step >= self.planned
            if self.step % r.val_every == 0 or done:
                record = self._record(running)
                running = []
                if not done:
                    self._plan()
                    bar.total = self.planned
                bar.set_postfix(loss=f"{record['train_loss']:.3f}", val=f"{self.served_loss(record):.3f}")
                if on_record:
                    on_record(record)
            if done:
                self.stopped = (
                    f"time budget of {r.time_budget_s:.0f} s spent" if out_of_time else f"{self.step} steps done"
                )
                break
        bar.close()
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        log.info("stopped after %d steps: %s", self.step, self.stopped)
        return self.history

    def _record(self, running: list[float]) -> dict[str, float]:
        record = {"step": float(self.step), "train_loss": statistics.fmean(running), **self.validate()}
        record["lr"] = self.lr_at(self.step)
        record["seconds"] = round(time.perf_counter() - self.wall_started, 1)
        record["budget_seconds"] = round(self.elapsed(), 1)  # on the budget's clock (wall or CPU)
        ramping = is_shuffle_robust(self.recipe.variant) and self.shuffle_chance() < 1.0
        record["kept"] = 0.0
        if not ramping and self.served_loss(record) < self.best_loss:
            self.best_loss = self.served_loss(record)
            self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            record["kept"] = 1.0
        self.history.append(record)
        return record

    def _plan(self) -> None:
        """Fit the schedule to the budget at the pace so far (validation included), so the cosine ends there."""
        pace = self.elapsed() / max(1, self.step)
        affordable = int(self.recipe.time_budget_s / pace)
        self.planned = max(self.step + 1, min(self.recipe.max_steps, affordable))
