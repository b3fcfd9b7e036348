"""The trainer: LayerShuffle and its variants, LayerDrop, and the sequential baseline.

Adam as in the paper (beta 0.9/0.999, eps 1e-6). For every batch, shuffle-robust variants run the
blocks in a fresh random order (LayerShuffle's Algorithm 1); stem and head always stay in place.
The checkpoint with the lowest validation loss is the one saved.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from .checkpoint import Lineage, Manifest, load_model
from .config import ViTConfig, is_shuffle_robust
from .data import Dataset
from .vit import Block, ViT

log = logging.getLogger(__name__)


@dataclass
class TrainRecipe:
    variant: str = "layershuffle"
    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 100
    seed: int = 0
    val_fraction: float = 0.1
    augment: bool = True
    threads: int = 0  # 0: leave torch's default


def batch_order(model: ViT, variant: str, gen: torch.Generator) -> list[int]:
    """The block order for one training batch."""
    depth = len(model.blocks)
    if is_shuffle_robust(variant):
        return torch.randperm(depth, generator=gen).tolist()
    if variant == "layerdrop":
        keep = torch.rand(depth, generator=gen) >= model.cfg.layerdrop
        kept = [i for i in range(depth) if keep[i]]
        return kept or [int(torch.randint(depth, (1,), generator=gen))]
    return list(range(depth))


def training_loss(model: ViT, images: Tensor, labels: Tensor, order: list[int]) -> Tensor:
    """Task cross-entropy, plus each block's position cross-entropy for layershuffle-predict."""
    x = model.stem(images)
    position_loss = images.new_zeros(())
    for position, index in enumerate(order):
        block: Block = model.blocks[index]  # type: ignore[assignment]
        x = block(x, position)
        if block.position_head is not None:
            target = torch.full((x.shape[0],), position, dtype=torch.long, device=x.device)
            position_loss = position_loss + F.cross_entropy(block.position_logits(x), target)
    return F.cross_entropy(model.head(x), labels) + position_loss


def _augment(images: Tensor, gen: torch.Generator) -> Tensor:
    """Random flips and small translations: cheap, and they keep tiny models from memorising."""
    flip = torch.rand(images.shape[0], generator=gen) < 0.5
    images = torch.where(flip[:, None, None, None], images.flip(-1), images)
    dy, dx = (int(v) for v in torch.randint(-2, 3, (2,), generator=gen))
    return torch.roll(images, shifts=(dy, dx), dims=(-2, -1))


@torch.no_grad()
def evaluate_loss(model: ViT, x: Tensor, y: Tensor, batch_size: int = 512) -> tuple[float, float]:
    model.eval()
    total_loss, correct = 0.0, 0
    for i in range(0, len(y), batch_size):
        logits = model(x[i : i + batch_size])
        total_loss += F.cross_entropy(logits, y[i : i + batch_size], reduction="sum").item()
        correct += int((logits.argmax(-1) == y[i : i + batch_size]).sum())
    return total_loss / len(y), correct / len(y)


class Trainer:
    """One training run: owns model, optimiser, schedule and the periodic train-state checkpoint."""

    def __init__(self, model: ViT, data: Dataset, recipe: TrainRecipe, device: torch.device, state_dir: Path):
        self.model, self.data, self.recipe, self.device = model.to(device), data, recipe, device
        self.state_dir = state_dir
        n_val = max(1, int(len(data.train_y) * recipe.val_fraction))
        split = torch.Generator().manual_seed(recipe.seed)
        perm = torch.randperm(len(data.train_y), generator=split)
        self.val_idx, self.train_idx = perm[:n_val], perm[n_val:]
        self.opt = torch.optim.Adam(
            model.parameters(), lr=recipe.lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=recipe.weight_decay
        )
        self.steps_per_epoch = math.ceil(len(self.train_idx) / recipe.batch_size)
        self.total_steps = self.steps_per_epoch * recipe.epochs
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.gen = torch.Generator().manual_seed(recipe.seed)
        self.epoch, self.best_val = 0, math.inf
        self.best_state: dict[str, Tensor] | None = None
        self.history: list[dict[str, float]] = []

    def _lr_factor(self, step: int) -> float:
        if step < self.recipe.warmup_steps:
            return (step + 1) / self.recipe.warmup_steps
        progress = (step - self.recipe.warmup_steps) / max(1, self.total_steps - self.recipe.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def fit(self, on_epoch: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
        x, y = self.data.train_x, self.data.train_y
        for epoch in range(self.epoch, self.recipe.epochs):
            self.model.train()
            perm = self.train_idx[torch.randperm(len(self.train_idx), generator=self.gen)]
            started, running = time.perf_counter(), 0.0
            bar = tqdm(
                range(self.steps_per_epoch),
                desc=f"epoch {epoch + 1}/{self.recipe.epochs}",
                leave=False,
                unit="batch",
                disable=None,
            )
            for step in bar:
                idx = perm[step * self.recipe.batch_size : (step + 1) * self.recipe.batch_size]
                images = x[idx]
                if self.recipe.augment:
                    images = _augment(images, self.gen)
                order = batch_order(self.model, self.recipe.variant, self.gen)
                loss = training_loss(self.model, images.to(self.device), y[idx].to(self.device), order)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                self.opt.step()
                self.sched.step()
                running += loss.item()
                bar.set_postfix(loss=f"{running / (step + 1):.3f}")
            val_loss, val_acc = evaluate_loss(
                self.model, x[self.val_idx].to(self.device), y[self.val_idx].to(self.device)
            )
            record = {
                "epoch": epoch + 1,
                "train_loss": running / self.steps_per_epoch,
                "val_loss": val_loss,
                "val_acc": val_acc,
                "seconds": time.perf_counter() - started,
            }
            self.history.append(record)
            log.info(
                "epoch %d: train loss %.4f, val loss %.4f, val acc %.4f",
                epoch + 1,
                record["train_loss"],
                val_loss,
                val_acc,
            )
            if val_loss < self.best_val:
                self.best_val = val_loss
                self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.epoch = epoch + 1
            self.save_state()
            if on_epoch:
                on_epoch(record)
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        return self.history[-1] if self.history else {}

    # --- resumable train state (safetensors + JSON: nothing is ever unpickled) ---------------------------

    def save_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        if self.best_state is not None:
            tensors.update({f"best.{k}": v.cpu().contiguous() for k, v in self.best_state.items()})
        for i, param in enumerate(self.model.parameters()):
            for key, value in self.opt.state.get(param, {}).items():
                tensors[f"opt.{i}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
        tensors["rng"] = self.gen.get_state()
        save_file(tensors, str(self.state_dir / "state.safetensors"))
        meta = {
            "epoch": self.epoch,
            "best_val": self.best_val,
            "history": self.history,
            "sched": self.sched.state_dict(),
            "recipe": asdict(self.recipe),
        }
        (self.state_dir / "state.json").write_text(json.dumps(meta, indent=1))

    def load_state(self) -> bool:
        path = self.state_dir / "state.safetensors"
        if not path.is_file():
            return False
        meta = json.loads((self.state_dir / "state.json").read_text())
        if meta["recipe"] != asdict(self.recipe):
            raise ValueError(f"cannot resume from {self.state_dir}: it was made with another recipe")
        tensors = load_file(str(path))
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        best = {k[5:]: v for k, v in tensors.items() if k.startswith("best.")}
        self.best_state = best or None
        for i, param in enumerate(self.model.parameters()):
            state = {k.split(".", 2)[2]: v.to(self.device) for k, v in tensors.items() if k.startswith(f"opt.{i}.")}
            if state:
                self.opt.state[param] = state
        self.gen.set_state(tensors["rng"])
        self.sched.load_state_dict(meta["sched"])
        self.epoch, self.best_val, self.history = meta["epoch"], meta["best_val"], meta["history"]
        log.info("resumed from %s at epoch %d", self.state_dir, self.epoch)
        return True


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
        from .hf_import import import_hf_vit

        return import_hf_vit(
            Path(init[3:]), variant=variant, num_classes=len(data.class_names), class_names=data.class_names
        )
    parent, manifest = load_model(init)
    return _fine_tune_copy(parent, manifest, data, variant)


def _fine_tune_copy(parent: ViT, manifest: Manifest, data: Dataset, variant: str) -> tuple[ViT, Lineage]:
    cfg = parent.cfg.replace(variant=variant)
    if cfg.architecture() != parent.cfg.architecture():
        raise ValueError(f"cannot fine-tune a {parent.cfg.variant} model as {variant}: the block shapes differ")
    if cfg.num_classes != len(data.class_names):
        raise ValueError(f"--init model has {cfg.num_classes} classes, the data has {len(data.class_names)}")
    model = ViT(cfg)
    model.load_state_dict(parent.state_dict())
    return model, Lineage(root=manifest.lineage.root, parent=manifest.model_id, source="model")
