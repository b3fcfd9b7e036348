"""The trainer: every variant learns, training resumes exactly, the CLI writes a usable model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layerswarm.cli import main
from layerswarm.models.checkpoint import load_model, read_manifest
from layerswarm.models.config import VARIANTS
from layerswarm.models.data import Dataset, load_dataset
from layerswarm.models.train import Trainer, TrainRecipe, batch_order, build_model, evaluate_loss

ARCH = {"depth": 3, "dim": 32, "heads": 2, "patch_size": 8}


@pytest.fixture(scope="module")
def data():  # type: ignore[no-untyped-def]
    return load_dataset("shapes1:512:128", seed=0)


@pytest.fixture(scope="module")
def easy_data() -> Dataset:
    """Four classes told apart by colour alone: any variant must learn them in a few dozen steps."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (640,), generator=gen)
    colours = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 1.0, 0]])
    images = colours[labels][:, :, None, None] * 0.6 + torch.rand(640, 3, 32, 32, generator=gen) * 0.4
    return Dataset("colours", "test", images[:512], labels[:512], images[512:], labels[512:], ("r", "g", "b", "y"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_short_training_lowers_the_loss(variant: str, easy_data: Dataset, tmp_path: Path) -> None:
    data = easy_data
    model, _ = build_model(data, variant, None, ARCH, seed=0)
    before, _ = evaluate_loss(model, data.test_x, data.test_y)
    trainer = Trainer(
        model,
        data,
        TrainRecipe(variant=variant, epochs=5, lr=3e-3, warmup_steps=5, batch_size=64),
        torch.device("cpu"),
        tmp_path / "state",
    )
    trainer.fit()
    after, _ = evaluate_loss(trainer.model, data.test_x, data.test_y)
    assert after < 0.8 * before, f"{variant}: loss {before:.3f} -> {after:.3f}"


def test_block_orders_per_variant(data) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    model, _ = build_model(data, "layershuffle", None, {**ARCH, "depth": 6}, seed=0)
    assert batch_order(model, "baseline", gen) == list(range(6))
    orders = {tuple(batch_order(model, "layershuffle", gen)) for _ in range(20)}
    assert len(orders) > 10 and all(sorted(o) == list(range(6)) for o in orders)
    dropped = [batch_order(model, "layerdrop", gen) for _ in range(50)]
    assert any(len(o) < 6 for o in dropped) and all(o == sorted(o) and o for o in dropped)


def test_resume_continues_exactly(data, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    recipe = TrainRecipe(variant="layershuffle", epochs=2, lr=3e-3, warmup_steps=5, batch_size=64)
    straight, _ = build_model(data, "layershuffle", None, ARCH, seed=0)
    Trainer(straight, data, recipe, torch.device("cpu"), tmp_path / "a").fit()

    first, _ = build_model(data, "layershuffle", None, ARCH, seed=0)
    t1 = Trainer(first, data, recipe, torch.device("cpu"), tmp_path / "b")
    t1.fit = t1.fit  # run one epoch, then "crash"
    t1.recipe.epochs = 1
    t1.fit()
    t1.recipe.epochs = 2
    t1.save_state()
    # The saved recipe must match for a resume: rewrite it as the 2-epoch recipe it is part of.
    resumed_model, _ = build_model(data, "layershuffle", None, ARCH, seed=123)  # different init: state must win
    t2 = Trainer(resumed_model, data, recipe, torch.device("cpu"), tmp_path / "b")
    assert t2.load_state() and t2.epoch == 1
    t2.fit()
    for (name, a), b in zip(straight.state_dict().items(), resumed_model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_cli_train_family_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base"
    common = [
        "--data",
        "shapes1:256:64",
        "--epochs",
        "1",
        "--depth",
        "3",
        "--dim",
        "32",
        "--heads",
        "2",
        "--warmup-steps",
        "2",
    ]
    assert main(["train", *common, "--variant", "baseline", "--out", str(base)]) == 0
    member = tmp_path / "member"
    assert (
        main(["train", *common, "--variant", "layershuffle", "--init", str(base), "--out", str(member), "--seed", "4"])
        == 0
    )
    m_base, m_member = read_manifest(base), read_manifest(member)
    assert m_member.family_id == m_base.family_id
    assert m_member.lineage.parent == m_base.model_id and m_member.lineage.source == "model"
    assert m_member.recipe["command"].startswith("layerswarm train")
    assert "test_sequential" in m_member.metrics
    report_path = tmp_path / "report.json"
    assert (
        main(
            [
                "eval",
                str(base),
                str(member),
                str(base),
                "--json",
                str(report_path),
                "--plots",
                str(tmp_path / "plots"),
                "--merges",
                "20",
                "--orders",
                "10",
            ]
        )
        == 0
    )
    report = json.loads(report_path.read_text())
    model_row = report["models"]["member"]
    assert set(model_row) >= {"sequential", "arbitrary", "pruned"}
    assert set(model_row["arbitrary"]) >= {"mean", "std"} and model_row["arbitrary"]["n"] == 10
    assert set(model_row["pruned"]) == {"1", "2", "3"}
    assert set(model_row["pruned"]["2"]) == {"sequential", "arbitrary"}
    group = next(iter(report["groups"].values()))  # base listed twice: a group of two baselines
    assert {"merged", "ensemble", "sequential", "arbitrary", "pruned"} <= set(group)
    assert group["merged"]["n"] == 20 and "std" in group["merged"]
    assert (tmp_path / "plots" / "accuracy_vs_blocks.png").stat().st_size > 1000
    assert "| member | layershuffle |" in capsys.readouterr().out


def test_cli_refuses_bad_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", "shapes", "--variant", "nope", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--variant" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # refused by the parser, before any work
        main(["train", "--data", "mnist", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "argument --data: 'mnist': expected shapes" in capsys.readouterr().err
    assert (
        main(["train", "--data", "shapes1:64:16", "--init", str(tmp_path / "missing"), "--out", str(tmp_path / "y")])
        == 2
    )
    assert "manifest" in capsys.readouterr().err


def test_trained_model_round_trips(tmp_path: Path, data) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "m"
    assert (
        main(
            [
                "train",
                "--data",
                "shapes1:128:32",
                "--epochs",
                "1",
                "--depth",
                "2",
                "--dim",
                "32",
                "--heads",
                "2",
                "--out",
                str(out),
                "--variant",
                "layershuffle-predict",
            ]
        )
        == 0
    )
    model, manifest = load_model(out)
    assert manifest.config.variant == "layershuffle-predict" and model.blocks[0].position_head is not None
