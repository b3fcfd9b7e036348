"""The trainer: LayerShuffle and its variants, LayerDrop, and the sequential baseline.

Adam as in the paper (beta 0.9/0.999, eps 1e-6; a weight decay is decoupled, as AdamW's). For every batch,
shuffle-robust variants run the blocks in a fresh random order (LayerShuffle's Algorithm 1); stem and head
always stay in place. The checkpoint with the lowest validation loss is the one saved.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from layerswarm.models.checkpoint import Lineage, Manifest, load_model, read_manifest
from layerswarm.models.config import ViTConfig, is_shuffle_robust
from layerswarm.models.vit import ViT

from .data.datasets import Dataset, check_same_classes, iterate_batches
from .data.split import validation_split
from .hf_import import import_hf_vit
from .objective import augment, batch_order, evaluate_loss, evaluate_objective, mixup_batch, training_loss
from .recipe import TrainRecipe
from .train_report import EpochRecord, describe_epoch, kept_by, peak_memory_mb
from .train_state import load_state, save_state

log = logging.getLogger(__name__)

# Below this many validation images one image moves accuracy by 2+ points: the warning says so.
FEW_VALIDATION = 50
VAL_ORDERS = 3  # random block orders behind the arbitrary-order validation accuracy


# Parameters no weight decay touches, as in timm's ViT: the learned position embedding and class token are
# lookups, not maps, and decaying them (or biases and norm gains, all 1-D) only pulls them toward zero.
NO_DECAY = ("pos_embed", "cls_token")


def decays(name: str, param: Tensor) -> bool:
    """Whether weight decay applies to this parameter: the weight matrices (and conv kernels) only."""
    return param.ndim >= 2 and not name.endswith(NO_DECAY)


def make_optimizer(model: ViT, recipe: TrainRecipe) -> torch.optim.Optimizer:
    """Adam as in the paper; with a weight decay, decoupled (AdamW, Loshchilov & Hutter 2019) and on the
    weight matrices only. One parameter group when there is none, as every run before had."""
    if not recipe.weight_decay:
        groups: list[dict[str, Any]] = [{"params": list(model.parameters()), "weight_decay": 0.0}]
    else:
        named = list(model.named_parameters())
        groups = [
            {"params": [p for n, p in named if decays(n, p)], "weight_decay": recipe.weight_decay},
            {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
        ]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.999), eps=1e-6)


class Trainer:
    """One training run: owns model, optimiser, schedule and the periodic train-state checkpoint."""

    def __init__(
        self,
        model: ViT,
        data: Dataset,
        recipe: TrainRecipe,
        device: torch.device,
        state_dir: Path,
        workers: int = 0,
    ):
        self.model, self.data, self.recipe, self.device = model.to(device), data, recipe, device
        model.set_drop_path(recipe.drop_path)
        if recipe.mixup and getattr(model, "training_loss", None) is not None:
            raise ValueError("--mixup is for images: text batches are token ids, which do not blend")
        self.state_dir, self.workers = state_dir, workers
        self.val_idx, self.train_idx = validation_split(
            data.train_y, recipe.val_fraction, recipe.seed, recipe.split_seed
        )
        if len(self.train_idx) == 0:
            raise ValueError(f"{len(data.train_y)} training image(s) leave none to train on after the validation split")
        if recipe.bootstrap:  # after the split: the validation images stay out of every resample
            draws = torch.randint(
                len(self.train_idx), (len(self.train_idx),), generator=torch.Generator().manual_seed(recipe.seed)
            )
            self.train_idx = self.train_idx[draws]
        n_val = len(self.val_idx)
        if n_val < FEW_VALIDATION:
            log.warning(
                "the validation split holds %d image(s): one image moves its accuracy by %.0f points, so early "
                "stopping, the epoch kept and the accuracy reported against chance and the reference are noise "
                "at this size; more images make them mean something",
                n_val,
                100 / n_val,
            )
        x = data.train_x
        self.val_x = x[self.val_idx] if isinstance(x, Tensor) else x.subset(self.val_idx)
        self.val_y = data.train_y[self.val_idx]
        # Fixed orders for the arbitrary-order validation figure: comparable across epochs and resumes.
        depth, orders_gen = len(model.blocks), torch.Generator().manual_seed(recipe.seed + 1)
        self.val_orders = [torch.randperm(depth, generator=orders_gen).tolist() for _ in range(VAL_ORDERS)]
        self.opt = make_optimizer(model, recipe)
        self.steps_per_epoch = math.ceil(len(self.train_idx) / recipe.batch_size)
        self.step_cap = self.total_steps = self.steps_per_epoch * recipe.epochs  # the schedule's longest
        self.history: list[EpochRecord] = []
        self.epoch_started: float | None = None
        self.stopped = ""  # why training ended before the last epoch, if it did
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.gen = torch.Generator().manual_seed(recipe.seed)
        self.epoch, self.best_val, self.stale = 0, math.inf, 0  # stale: validations since the best
        self.planned = False  # whether the time budget has set total_steps yet
        self.best_state: dict[str, Tensor] | None = None

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up, then a cosine to zero at the last step or at the time budget, whichever is nearer."""
        if step < self.recipe.warmup_steps:
            return (step + 1) / self.recipe.warmup_steps
        progress = (step - self.recipe.warmup_steps) / max(1, self.total_steps - self.recipe.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def _plan_steps(self) -> None:
        """After every epoch: fit the schedule to the steps the time budget allows at the pace so far, so
        the cosine ends at the budget (the pace of a shared machine changes: one epoch is a poor guess).
        Saved with the train state, so a resumed run goes on with the same plan."""
        done = int(self.sched.last_epoch)
        affordable = int(self.recipe.time_budget_s * done / max(self.trained_seconds(), 1e-9))
        self.total_steps = max(done + 1, min(self.step_cap, affordable))
        self.planned = True
        log.info("schedule: %d optimizer steps (time budget %.0f s)", self.total_steps, self.recipe.time_budget_s)

    def trained_seconds(self) -> float:
        """Wall-clock seconds spent in training steps so far (earlier epochs, resumed ones included)."""
        running = time.perf_counter() - self.epoch_started if self.epoch_started is not None else 0.0
        return sum(r["seconds"] for r in self.history) + running

    def out_of_time(self) -> bool:
        return self.trained_seconds() >= self.recipe.time_budget_s

    def schedule_done(self) -> bool:
        return int(self.sched.last_epoch) >= self.total_steps

    def shuffle_chance(self) -> float:
        """The chance that this step's batch is shuffled: rising linearly over the first `shuffle_ramp` of
        the step schedule (as planned now), then 1."""
        ramp = self.recipe.shuffle_ramp
        if ramp == 0.0:
            return 1.0
        return min(1.0, int(self.sched.last_epoch) / (ramp * self.total_steps))

    def ramping(self) -> bool:
        """Whether some batches still run in order. A model chosen then would be chosen by its accuracy in
        order (the validation loss), which says nothing of the orders the swarm will run it in: the kept
        model and early stopping wait for the ramp's end, as patience waits for the warm-up's."""
        return is_shuffle_robust(self.recipe.variant) and self.shuffle_chance() < 1.0

    def warming_up(self) -> bool:
        """Whether the learning rate is still rising. A validation loss that did not fall then says nothing
        of overfitting, so patience does not count it: on a few hundred images an epoch is one or two steps,
        and counting from the first epoch ended training at chance some 18 steps into a 100-step warm-up."""
        return int(self.sched.last_epoch) < self.recipe.warmup_steps

    def _stop_reason(self) -> str | None:
        if self.out_of_time():
            return f"time budget of {self.recipe.time_budget_s:.0f} s spent"
        if self.schedule_done():
            return f"schedule of {self.total_steps} steps done"
        if self.recipe.patience and self.stale >= self.recipe.patience:
            return f"validation loss has not improved for {self.stale} epochs"
        return None

    def fit(self, on_epoch: Callable[[EpochRecord], None] | None = None) -> EpochRecord:
        for epoch in range(self.epoch, self.recipe.epochs):
            record = self._train_epoch(epoch)
            record.update(self._validate())
            self.history.append(record)
            self._plan_steps()  # with this epoch's seconds in the history
            record["planned_steps"] = self.total_steps
            log.info("%s", describe_epoch(record, self.recipe.epochs))
            # The kept model and patience wait for the ramp's end (see ramping()); the mark tells the
            # reports which epoch's weights these are, which need not be the lowest validation loss.
            record["kept"] = 0.0 if self.ramping() else float(self._keep_if_best(kept_by(record)))
            self.epoch = epoch + 1
            self.save_state()
            if on_epoch:
                on_epoch(record)
            reason = self._stop_reason()
            if reason:
                self.stopped = f"stopped after epoch {self.epoch}: {reason}"
                log.info("%s", self.stopped)
                break
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        return self.history[-1] if self.history else {}

    def _keep_if_best(self, val_loss: float) -> bool:
        """Keep this epoch's weights if its validation loss is the lowest yet; whether it was kept."""
        if val_loss < self.best_val:
            self.best_val, self.stale = val_loss, 0
            self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            return True
        if not self.warming_up():
            self.stale += 1
        return False

    def _train_epoch(self, epoch: int) -> EpochRecord:
        self.model.train()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        perm = self.train_idx[torch.randperm(len(self.train_idx), generator=self.gen)]
        size = self.recipe.batch_size
        index_batches = [perm[s * size : (s + 1) * size] for s in range(self.steps_per_epoch)]
        batches = iterate_batches(self.data.train_x, index_batches, self.workers)
        self.epoch_started = started = time.perf_counter()
        cpu_started, running, steps = time.process_time(), 0.0, 0
        bar = tqdm(
            zip(index_batches, batches, strict=True),
            total=self.steps_per_epoch,
            desc=f"epoch {epoch + 1}/{self.recipe.epochs}",
            leave=True,  # one line per epoch stays on screen: the run's history at a glance
            unit="batch",
            disable=None,
        )
        for step, (idx, batch) in enumerate(bar):
            images = augment(batch, self.gen, self.recipe.hflip) if self.recipe.augment else batch
            order = batch_order(self.model, self.recipe.variant, self.gen, self.shuffle_chance())
            labels = self.data.train_y[idx].to(self.device)
            mix = None
            if self.recipe.mixup:  # after the shifts: a blend of two shifted images; 0 draws nothing
                images, mix = mixup_batch(images, labels, self.recipe.mixup, self.gen)
            loss = training_loss(
                self.model,
                images.to(self.device),
                labels,
                order,
                self.recipe.exit_loss,
                self.recipe.label_smoothing,
                mix,
            )
            self.opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            self.opt.step()
            self.sched.step()
            running, steps = running + loss.item(), step + 1
            bar.set_postfix(loss=f"{running / steps:.3f}")
            if self.out_of_time() or self.schedule_done():  # ends the epoch early: validate what was trained
                break
        bar.close()
        seconds, self.epoch_started = time.perf_counter() - started, None
        record: EpochRecord = {
            "epoch": epoch + 1,
            "train_loss": running / max(1, steps),
            "seconds": seconds,
            "step_s": seconds / max(1, steps),
            # CPU seconds of this process (all its threads): what a step costs when the machine is shared
            "step_cpu_s": (time.process_time() - cpu_started) / max(1, steps),
        }
        record.update(peak_memory_mb(self.device))
        return record

    def _validate(self) -> EpochRecord:
        val_loss, val_acc = evaluate_loss(self.model, self.val_x, self.val_y, workers=self.workers)
        arbitrary = [
            evaluate_loss(self.model, self.val_x, self.val_y, order=o, workers=self.workers)[1] for o in self.val_orders
        ]
        record: EpochRecord = {
            "val_loss": val_loss,
            "val_acc": val_acc,
            "val_acc_arbitrary": sum(arbitrary) / len(arbitrary),
        }
        if self.recipe.exit_loss > 0:
            # Kept by the objective trained: by the last block's loss in order alone, exit-aware fine-tunes
            # of the shipped members kept their first epoch, the one that had learnt least to exit early.
            record["val_exit_objective"] = evaluate_objective(
                self.model, self.val_x, self.val_y, self.val_orders, self.recipe.exit_loss, workers=self.workers
            )
        return record

    # --- resumable train state (training/train_state.py) -----------------------------------------------

    def save_state(self) -> None:
        save_state(self)

    def load_state(self) -> bool:
        """Continue from the saved state, if any (False: none); ValueError when it is another run's."""
        return load_state(self)


def init_image_size(init: str) -> int:
    """The image side of an --init model: from its manifest, or a Hugging Face config.json."""
    if init.startswith("hf:"):
        config = Path(init[3:]) / "config.json"
        if not config.is_file():
            raise ValueError(f"--init {init}: missing config.json (expected a Hugging Face ViT directory)")
        return int(json.loads(config.read_text()).get("image_size", 224))
    return read_manifest(init).config.image_size


def build_model(
    data: Dataset,
    variant: str,
    init: str | None,
    arch: dict[str, Any],
    seed: int,
) -> tuple[ViT, Lineage]:
    """A fresh model, one fine-tuned from a model directory, or one imported from Hugging Face."""
    torch.manual_seed(seed)
    c, h, _ = data.image_shape
    if init is None:
        cfg = ViTConfig(
            image_size=h,
            in_channels=c,
            num_classes=len(data.class_names),
            variant=variant,
            class_names=data.class_names,
            **arch,
        )
        model = ViT(cfg)
        return model, Lineage(source="scratch")  # its own root, fixed when it is saved
    if init.startswith("hf:"):
        model, lineage = import_hf_vit(
            Path(init[3:]), variant=variant, num_classes=len(data.class_names), class_names=data.class_names
        )
    else:
        parent, manifest = load_model(init)
        model, lineage = _fine_tune_copy(parent, manifest, data, variant)
        hint = "; to learn other classes, train from scratch"
        check_same_classes(model.cfg.class_names, data.class_names, f"--init {init}", hint)
    if (h, c) != (model.cfg.image_size, model.cfg.in_channels):
        raise ValueError(
            f"the data is {c}x{h}x{h}, the --init model takes {model.cfg.in_channels}x{model.cfg.image_size}x"
            f"{model.cfg.image_size}: load the data at the model's --image-size"
        )
    return model, lineage


def _fine_tune_copy(parent: ViT, manifest: Manifest, data: Dataset, variant: str) -> tuple[ViT, Lineage]:
    cfg = parent.cfg.replace(variant=variant)
    if cfg.architecture() != parent.cfg.architecture():
        raise ValueError(f"cannot fine-tune a {parent.cfg.variant} model as {variant}: the block shapes differ")
    if cfg.num_classes != len(data.class_names):
        raise ValueError(f"--init model has {cfg.num_classes} classes, the data has {len(data.class_names)}")
    model = ViT(cfg)
    model.load_state_dict(parent.state_dict())
    return model, Lineage(root=manifest.lineage.root, parent=manifest.model_id, source="model")
