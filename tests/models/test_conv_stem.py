"""The defaults that let a from-scratch ViT learn a user's own data: a convolutional stem that survives
save/load and the coordinator's stem loading, early stopping on validation, and old model directories
(patch stem, written before the conv stem existed) that load and compute exactly as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from layerswarm.models.checkpoint import Lineage, load_model, load_stem_head, save_model
from layerswarm.models.config import ViTConfig
from layerswarm.models.vit import ShallowConvEmbed, ViT, run_blocks
from layerswarm.training.data.datasets import Dataset
from layerswarm.training.objective import random_translate
from layerswarm.training.recipe import TrainRecipe
from layerswarm.training.train import Trainer

ZOO_MODEL = Path(__file__).parent.parent.parent / "src" / "layerswarm" / "models" / "zoo" / "shapes" / "layershuffle-0"


def _conv_model(stem: str = "conv") -> ViT:
    torch.manual_seed(0)
    return ViT(ViTConfig(image_size=16, patch_size=4, num_classes=3, dim=32, depth=2, heads=2, stem=stem))


@pytest.mark.parametrize("stem", ["conv", "shallow"])
def test_conv_stem_round_trips_through_save_load_and_the_coordinators_stem(tmp_path: Path, stem: str) -> None:
    model = _conv_model(stem)
    images = torch.rand(5, 3, 16, 16)
    with torch.no_grad():  # a few training steps' worth of BatchNorm statistics, so they must be saved too
        model.train()(torch.rand(32, 3, 16, 16) * 2)
    model.eval()
    manifest = save_model(model, tmp_path / "m", Lineage(source="scratch"))
    assert manifest.config.stem == stem and f'"stem": "{stem}"' in (tmp_path / "m" / "manifest.json").read_text()
    loaded, _ = load_model(tmp_path / "m")
    assert loaded.cfg.stem == stem
    with torch.no_grad():
        expected = model(images)
        assert torch.equal(loaded.eval()(images), expected)
        stem, head = load_stem_head(tmp_path / "m")  # what the coordinator runs
        assert torch.equal(head(run_blocks(list(loaded.blocks), stem.eval()(images))), expected)
    assert any("running_mean" in k for k in stem.state_dict())
    assert stem(images).shape == (5, 1 + 16, 32)  # (B, 1 + (16/4)^2, D): the tokens a patch stem makes


def test_the_shallow_stem_is_one_full_resolution_conv_then_the_patch_embedding() -> None:
    """`--stem shallow`: each token sees its patch and one pixel around it (a 3x3 conv, then a PxP stride-P
    conv), where ConvEmbed's stride-2 convs give it a wider view: what a token sees is what the blocks are
    left to compose. Measured by the receptive field: a pixel changed two columns left of the second 4 x 4
    patch (columns 4-7) moves ConvEmbed's token for that patch (it sees columns 1-7) and not the shallow
    stem's (columns 3-8)."""
    images = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    moved = images.clone()
    moved[0, :, 5, 2] += 1.0
    reach = {}
    for stem in ("conv", "shallow"):
        model = _conv_model(stem).eval()
        embed = model.stem.conv_embed
        with torch.no_grad():
            reach[stem] = bool((embed(moved) - embed(images))[0, :, 1, 1].abs().max() > 0)
    convs = [m for m in _conv_model("shallow").stem.conv_embed.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.kernel_size, c.stride) for c in convs] == [((3, 3), (1, 1)), ((4, 4), (4, 4))]
    assert reach == {"conv": True, "shallow": False}


def test_train_with_the_shallow_stem_writes_it_into_config_and_recipe(tmp_path: Path) -> None:
    from layerswarm.cli import main

    tiny = ["--depth", "2", "--dim", "16", "--heads", "2", "--epochs", "1", "--no-reference", "--workers", "0"]
    assert main(["train", "--data", "shapes:64:16", "--stem", "shallow", *tiny, "--out", str(tmp_path / "m")]) == 0
    model, manifest = load_model(tmp_path / "m")
    assert manifest.config.stem == "shallow" and manifest.recipe["stem"] == "shallow"
    assert manifest.config.patch_size == 8 and isinstance(model.stem.conv_embed, ShallowConvEmbed)  # 4 x 4 tokens


def test_config_refuses_a_bad_stem() -> None:
    with pytest.raises(ValueError, match="unknown stem"):
        ViTConfig(stem="resnet")
    with pytest.raises(ValueError, match="power-of-two"):
        ViTConfig(image_size=24, patch_size=3, stem="conv")


def test_old_model_dirs_load_as_patch_stems_and_compute_exactly_as_before() -> None:
    """The shipped zoo has no 'stem' in its config: it loads (its model id, a hash of the config, still
    matches), gets the patch stem, and its logits are exactly those of the patch embedding written out."""
    model, manifest = load_model(ZOO_MODEL)
    assert "stem" not in manifest.config.to_dict() and model.cfg.stem == "patch"
    assert set(model.stem.state_dict()) == {"patch_embed.weight", "patch_embed.bias", "cls_token", "pos_embed"}
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    stem = model.stem
    with torch.no_grad():
        x = F.conv2d((images - 0.5) / 0.5, stem.patch_embed.weight, stem.patch_embed.bias, stride=8)
        x = torch.cat([stem.cls_token.expand(4, -1, -1), x.flatten(2).transpose(1, 2)], 1) + stem.pos_embed
        by_hand = model.head(run_blocks(list(model.blocks), x))
        assert torch.equal(model.eval()(images), by_hand)


def _tiny_data(n: int) -> Dataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(n, 3, 8, 8, generator=gen)
    y = torch.randint(0, 2, (n,), generator=gen)  # random labels: validation cannot improve for long
    return Dataset("noise", "noise", x, y, x[:8], y[:8], ("a", "b"))


def test_training_stops_early_when_validation_stalls_and_keeps_the_best(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, patch_size=2, num_classes=2, dim=16, depth=2, heads=2, stem="conv"))
    recipe = TrainRecipe(epochs=60, patience=3, lr=3e-3, warmup_steps=2, batch_size=32, augment=False)
    trainer = Trainer(model, _tiny_data(160), recipe, torch.device("cpu"), tmp_path / "state")
    trainer.fit()
    losses = [r["val_loss"] for r in trainer.history]
    best = losses.index(min(losses))
    assert len(losses) == best + 1 + 3 < 60  # exactly `patience` epochs after the best, then it stopped
    assert "not improved for 3 epochs" in trainer.stopped
    kept = trainer._validate()["val_loss"]
    assert kept == pytest.approx(min(losses), abs=1e-6)  # the best epoch's weights are the ones kept


def test_a_time_budget_ends_training_with_the_schedule_annealed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, patch_size=2, num_classes=2, dim=16, depth=2, heads=2, stem="conv"))
    recipe = TrainRecipe(epochs=10_000, patience=0, time_budget_s=1.0, warmup_steps=1, batch_size=32)
    trainer = Trainer(model, _tiny_data(160), recipe, torch.device("cpu"), tmp_path / "state")
    trainer.fit()
    assert trainer.planned and trainer.total_steps < 10_000 * trainer.steps_per_epoch  # cut to the budget
    assert "time budget" in trainer.stopped or "schedule of" in trainer.stopped
    assert trainer.history[-1]["planned_steps"] == trainer.total_steps  # re-planned every epoch, recorded
    if "schedule of" in trainer.stopped:
        assert trainer.sched.get_last_lr()[0] < 1e-9  # the cosine reached its end


def test_translations_move_each_image_on_its_own_and_never_wrap() -> None:
    images = torch.ones(64, 1, 6, 6)
    out = random_translate(images, torch.Generator().manual_seed(0), 2)
    assert out.shape == images.shape
    assert len({tuple(o.nonzero()[0].tolist()) for o in out}) > 1  # not one shift for the whole batch
    for o in out:  # a shifted block of ones, zeros shifted in: nothing came round from the other side
        rows, cols = o[0].sum(1) > 0, o[0].sum(0) > 0
        assert o[0][rows][:, cols].all() and o.sum() == rows.sum() * cols.sum()


def test_patience_does_not_count_epochs_of_the_warm_up(tmp_path: Path) -> None:
    """A few hundred images make an epoch of one step: early stopping counted the warm-up's epochs and
    ended a run at chance long before the rate had risen. Here nothing can improve (lr 0, a patch stem: no
    BatchNorm statistics move), so only the epochs after the 6-step warm-up may count towards patience 2."""
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, patch_size=2, num_classes=2, dim=16, depth=2, heads=2, stem="patch"))
    recipe = TrainRecipe(epochs=60, patience=2, lr=0.0, warmup_steps=6, batch_size=256, augment=False)
    trainer = Trainer(model, _tiny_data(160), recipe, torch.device("cpu"), tmp_path / "state")
    assert trainer.steps_per_epoch == 1
    trainer.fit()
    assert len(trainer.history) == 7  # epoch 1 the best; 2-5 in the warm-up; 6 and 7 stale: stopped
    assert "not improved for 2 epochs" in trainer.stopped
