"""Mixup (`layerswarm train --mixup ALPHA`): validated, off by default and then bit-identical to plain
training, a lam-weighted loss whose two label sets follow the images they were blended from, recorded in
the manifest and inherited by family members."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from layerswarm.cli import main
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.config import ViTConfig
from layerswarm.models.vit import ViT
from layerswarm.training import family, train
from layerswarm.training.data.datasets import Dataset
from layerswarm.training.family import inherited_augmentation
from layerswarm.training.objective import Mix, label_loss, mixup_batch, training_loss
from layerswarm.training.recipe import TrainRecipe
from layerswarm.training.train import Trainer

from ..colour_data import colour_images

CLASSES = 4


def _model(variant: str = "layershuffle") -> ViT:
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, num_classes=CLASSES, depth=2, dim=16, heads=2, patch_size=4, variant=variant)
    return ViT(cfg).eval()  # eval: no dropout, so two forward passes agree exactly


def _batch(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Each class its own colour, plus noise."""
    labels = torch.arange(n) % CLASSES
    return colour_images(labels, 16, torch.Generator().manual_seed(1)), labels


def _told_apart() -> ViT:
    """A model whose logits depend on the image (a fresh one gives every image nearly the same logits, and
    then any permutation of the labels scores alike): a few steps on the colours of `_batch`."""
    model, (images, labels) = _model().train(), _batch(16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):
        opt.zero_grad()
        F.cross_entropy(model(images, [0, 1]), labels).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return model.eval()


@pytest.mark.parametrize("alpha", [-0.1, math.nan, math.inf])
def test_recipe_refuses_a_negative_or_non_finite_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match="mixup"):
        TrainRecipe(mixup=alpha)
    assert TrainRecipe().mixup == 0.0 and TrainRecipe(mixup=0.2).mixup == 0.2


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "x"])
def test_cli_refuses_a_bad_alpha_naming_the_flag(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--data", "shapes:64:16", "--out", "unused", "--mixup", value])
    assert exit_info.value.code == 2 and "--mixup" in capsys.readouterr().err


def test_without_mixup_the_loss_is_plain_label_smoothed_cross_entropy() -> None:
    model, (images, labels) = _model(), _batch()
    order = [1, 0]
    loss = training_loss(model, images, labels, order, label_smoothing=0.1)
    expected = F.cross_entropy(model(images, order), labels, label_smoothing=0.1)
    assert torch.equal(loss, expected)
    same = training_loss(model, images, labels, order, label_smoothing=0.1, mix=Mix(labels.flip(0), 1.0))
    assert torch.allclose(same, expected)  # lam 1: all weight on the batch's own labels


def test_mixup_off_draws_nothing_and_trains_exactly_as_before(tmp_path: Path) -> None:
    """mixup = 0 takes no random numbers and passes no mix: the run is the one the trainer made before
    mixup existed (same generator stream, same weights)."""
    gen = torch.Generator().manual_seed(2)
    images, labels = torch.rand(40, 3, 16, 16, generator=gen), torch.arange(40) % CLASSES
    data = Dataset("t", "t", images, labels, images, labels, ("a",) * CLASSES)
    recipe = dict(epochs=2, batch_size=16, warmup_steps=1, exit_loss=0.5)
    runs = []
    for mixup in (0.0, 0.0, 0.3):
        trainer = Trainer(_model(), data, TrainRecipe(**recipe, mixup=mixup), torch.device("cpu"), tmp_path / "s")
        trainer.fit()
        runs.append((trainer.gen.get_state(), trainer.model.state_dict()))
    (state0, weights0), (state1, weights1), (state_mix, weights_mix) = runs
    assert torch.equal(state0, state1) and all(torch.equal(weights0[k], weights1[k]) for k in weights0)
    assert not torch.equal(state0, state_mix)  # alpha > 0 does draw: the check above is not vacuous
    assert not all(torch.equal(weights0[k], weights_mix[k]) for k in weights0)


def test_mixup_batch_blends_images_and_permutes_labels_together() -> None:
    """Image i of the batch is filled with its label's value, so a blended image must read back as
    lam x its label + (1 - lam) x its partner's label: a partner label from another permutation fails."""
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 3, 2])
    images = labels.float()[:, None, None, None].expand(-1, 3, 4, 4).clone()
    gen = torch.Generator().manual_seed(5)
    lams = []
    for _ in range(20):
        mixed, mix = mixup_batch(images, labels, 0.4, gen)
        assert 0.0 <= mix.lam <= 1.0 and mixed.shape == images.shape
        expected = mix.lam * labels.float() + (1 - mix.lam) * mix.labels.float()
        assert torch.allclose(mixed[:, 0, 0, 0], expected, atol=1e-6)
        assert sorted(mix.labels.tolist()) == sorted(labels.tolist())  # a permutation of the batch's labels
        lams.append(mix.lam)
    assert len(set(lams)) == 20  # one lam per batch
    again = torch.Generator().manual_seed(5)
    assert mixup_batch(images, labels, 0.4, again)[1].lam == lams[0]  # reproducible from the seed


def test_mixup_loss_is_the_lam_weighted_pair_of_cross_entropies() -> None:
    """A step's loss equals lam x CE(y) + (1 - lam) x CE(y[perm]) on lam x x + (1 - lam) x x[perm], by
    hand from the same draws (a seed for the Beta, then the permutation), early exits weighted alike."""
    model, (images, labels) = _told_apart(), _batch()
    seed_gen = torch.Generator().manual_seed(9)
    mixed, mix = mixup_batch(images, labels, 0.2, seed_gen)
    by_hand_gen = torch.Generator().manual_seed(9)
    lam = float(np.random.default_rng(int(torch.randint(2**62, (1,), generator=by_hand_gen))).beta(0.2, 0.2))
    perm = torch.randperm(len(labels), generator=by_hand_gen)
    assert mix.lam == lam and 0.2 < lam < 0.8 and not torch.equal(perm, torch.arange(len(labels)))
    hand_images = lam * images + (1 - lam) * images[perm]
    assert torch.allclose(mixed, hand_images)
    order = [0, 1]
    logits = model(hand_images, order)
    by_hand = lam * F.cross_entropy(logits, labels, label_smoothing=0.1)
    by_hand = by_hand + (1 - lam) * F.cross_entropy(logits, labels[perm], label_smoothing=0.1)
    loss = training_loss(model, mixed, labels, order, label_smoothing=0.1, mix=mix)
    assert torch.allclose(loss, by_hand, atol=1e-6)
    unpermuted = F.cross_entropy(logits, labels, label_smoothing=0.1)  # what forgetting the partners gives
    assert not torch.allclose(loss, unpermuted, atol=1e-3)
    # early exits: the head after block 1 of 2, the same lam-weighted targets (no label smoothing there)
    first = model.blocks[order[0]](model.stem(mixed), 0)
    exit_term = label_loss(model.head(first), labels, mix=mix)
    with_exit = training_loss(model, mixed, labels, order, exit_loss=0.5, label_smoothing=0.1, mix=mix)
    assert torch.allclose(with_exit, by_hand + 0.5 * exit_term, atol=1e-6)
    assert torch.allclose(
        exit_term,
        lam * F.cross_entropy(model.head(first), labels) + (1 - lam) * F.cross_entropy(model.head(first), labels[perm]),
    )


def test_the_trainer_mixes_training_batches_with_their_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a training epoch: every batch the loss sees is blended, and its two label sets are the ones
    the images were blended from (each image is its label's value)."""
    labels = torch.arange(48) % CLASSES
    images = labels.float()[:, None, None, None].expand(-1, 3, 16, 16).clone()
    data = Dataset("t", "t", images, labels, images, labels, ("a",) * CLASSES)
    seen: list[tuple[torch.Tensor, torch.Tensor, Mix | None]] = []
    real = train.training_loss

    def spy(model: ViT, x: torch.Tensor, y: torch.Tensor, order: list[int], *rest: Any) -> torch.Tensor:
        seen.append((x, y, rest[2] if len(rest) > 2 else None))
        return real(model, x, y, order, *rest)

    monkeypatch.setattr(train, "training_loss", spy)
    recipe = TrainRecipe(epochs=1, batch_size=16, warmup_steps=1, augment=False, mixup=1.0)
    Trainer(_model("baseline").train(), data, recipe, torch.device("cpu"), tmp_path / "s").fit()
    assert len(seen) == 3
    for x, y, mix in seen:
        assert mix is not None
        assert torch.allclose(x[:, 0, 0, 0], mix.lam * y.float() + (1 - mix.lam) * mix.labels.float(), atol=1e-6)


def test_manifest_records_mixup_and_family_members_inherit_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base"
    argv = ["train", "--data", "shapes1:64:16", "--out", str(base), "--epochs", "1", "--depth", "2", "--dim", "16"]
    argv += ["--heads", "2", "--warmup-steps", "1", "--no-reference", "--workers", "0", "--mixup", "0.2"]
    assert main(argv) == 0
    assert read_manifest(base).recipe["mixup"] == 0.2
    assert inherited_augmentation({"augment": True, "hflip": False, "mixup": 0.2}) == ["--mixup", "0.2"]
    assert inherited_augmentation({"augment": True, "hflip": False}) == []  # recorded before mixup: off
    assert inherited_augmentation({"augment": False, "drop_path": 0.1, "mixup": 0.4}) == [
        *("--no-augment", "--drop-path", "0.1", "--mixup", "0.4")
    ]
    launched: list[list[str]] = []

    def capture(cmds: list[list[str]], jobs: int) -> int:
        launched.extend(cmds)
        return len(cmds)  # "failed": nothing is trained, the command lines are what is checked

    monkeypatch.setattr(family, "run_parallel", capture)
    assert main(["family", "--base", str(base), "--out", str(tmp_path / "fam"), "--members", "2"]) == 1
    assert len(launched) == 2
    for cmd in launched:
        i = cmd.index("--mixup")
        assert cmd[i + 1] == "0.2"


def test_text_training_refuses_mixup() -> None:
    """Token ids do not blend: a text model with mixup asked for is refused, not silently trained plain."""
    cfg = ViTConfig(kind="text", vocab_size=32, max_tokens=8, num_classes=2, depth=1, dim=16, heads=2)
    from layerswarm.models.text.model import TextEncoder

    ids = torch.randint(0, 32, (8, 8))
    data = Dataset("t", "t", ids, torch.arange(8) % 2, ids, torch.arange(8) % 2, ("a", "b"))
    with pytest.raises(ValueError, match="mixup is for images"):
        Trainer(TextEncoder(cfg), data, TrainRecipe(mixup=0.2, augment=False), torch.device("cpu"), Path("unused"))
