"""Exit-aware training (`layerswarm train --exit-loss W`) keeps the weights of its lowest validation
objective, the one it trains: the last block's loss plus W times the head's after every truncation depth.
Kept by the last block's loss in order alone, the shipped members' exit-aware fine-tunes kept their first
epoch, the one that had learnt least to exit early (issue 42)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from layerswarm.models.config import ViTConfig
from layerswarm.models.vit import ViT
from layerswarm.training.data.datasets import Dataset
from layerswarm.training.objective import evaluate_loss, evaluate_objective
from layerswarm.training.recipe import TrainRecipe
from layerswarm.training.train import Trainer
from layerswarm.training.train_report import kept_by

CLASSES = 4


def _model() -> ViT:
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, num_classes=CLASSES, depth=3, dim=16, heads=2, patch_size=4, variant="layershuffle")
    return ViT(cfg).eval()


def test_the_objective_is_the_last_blocks_loss_plus_the_early_exits() -> None:
    model = _model()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.rand(10, 3, 16, 16, generator=gen), torch.arange(10) % CLASSES
    order = [2, 0, 1]
    last = evaluate_loss(model, x, y, order=order)[0]
    assert evaluate_objective(model, x, y, [order], 0.0) == pytest.approx(last, rel=1e-5)
    with torch.no_grad():
        h1 = model.blocks[2](model.stem(x), 0)
        h2 = model.blocks[0](h1, 1)
        early = (F.cross_entropy(model.head(h1), y) + F.cross_entropy(model.head(h2), y)).item() / 2
    assert evaluate_objective(model, x, y, [order], 0.5) == pytest.approx(last + 0.5 * early, rel=1e-5)


def test_an_exit_aware_run_is_kept_by_its_objective_a_plain_run_by_its_loss(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    images, labels = torch.rand(40, 3, 16, 16, generator=gen), torch.arange(40) % CLASSES
    data = Dataset("t", "t", images, labels, images, labels, ("a",) * CLASSES)
    for exit_loss in (0.0, 0.5):
        recipe = TrainRecipe(epochs=2, batch_size=16, warmup_steps=1, exit_loss=exit_loss)
        trainer = Trainer(_model(), data, recipe, torch.device("cpu"), tmp_path / f"s{exit_loss}")
        trainer.fit()
        assert all(("val_exit_objective" in r) == (exit_loss > 0) for r in trainer.history)
        assert trainer.best_val == min(kept_by(r) for r in trainer.history)
    assert kept_by({"val_loss": 0.1, "val_exit_objective": 0.7}) == 0.7  # not the lower in-order loss
    assert kept_by({"val_loss": 0.1}) == 0.1
