"""The trainer: every variant learns, training resumes exactly, the CLI writes a usable model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from layerswarm.cli import main
from layerswarm.models.checkpoint import load_model, read_manifest
from layerswarm.models.config import VARIANTS
from layerswarm.training.data.datasets import Dataset, load_dataset
from layerswarm.training.data.split import validation_split
from layerswarm.training.objective import batch_order, evaluate_loss
from layerswarm.training.train import Trainer, TrainRecipe, build_model
from layerswarm.training.train_state import read_state, saved_time_budget

from ..colour_data import colour_dataset

ARCH = {"depth": 3, "dim": 32, "heads": 2, "patch_size": 8}


@pytest.fixture(scope="module")
def data():  # type: ignore[no-untyped-def]
    return load_dataset("shapes1:512:128", seed=0)


@pytest.fixture(scope="module")
def easy_data() -> Dataset:
    """Four classes told apart by colour alone: any variant must learn them in a few dozen steps."""
    return colour_dataset(640, train=512)


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


def test_resume_refuses_a_state_of_other_data_or_another_model(easy_data: Dataset, tmp_path: Path) -> None:
    """--resume in an --out whose state came from another --data of as many classes went on training the
    other data's weights, silently; with another class count or --dim it stopped in a traceback."""
    recipe = TrainRecipe(variant="layershuffle", epochs=1, lr=3e-3, warmup_steps=5, batch_size=64)
    model, _ = build_model(easy_data, "layershuffle", None, ARCH, seed=0)
    Trainer(model, easy_data, recipe, torch.device("cpu"), tmp_path / "state").fit()
    same, _ = build_model(easy_data, "layershuffle", None, ARCH, seed=1)
    assert Trainer(same, easy_data, recipe, torch.device("cpu"), tmp_path / "state").load_state()
    renamed = Dataset(
        "colours", "other", easy_data.train_x, easy_data.train_y, easy_data.test_x, easy_data.test_y, tuple("wxyz")
    )
    other, _ = build_model(renamed, "layershuffle", None, ARCH, seed=0)
    with pytest.raises(ValueError, match=r"other data \(classes \['r', 'g', 'b', 'y'\], now \['w', 'x', 'y', 'z'\]"):
        Trainer(other, renamed, recipe, torch.device("cpu"), tmp_path / "state").load_state()
    wider, _ = build_model(easy_data, "layershuffle", None, {**ARCH, "dim": 48}, seed=0)
    with pytest.raises(ValueError, match=r"other model \(dim 32, now 48\)"):
        Trainer(wider, easy_data, recipe, torch.device("cpu"), tmp_path / "state").load_state()


def test_a_train_state_is_one_file_replaced_whole_and_a_broken_one_is_named(easy_data: Dataset, tmp_path: Path) -> None:
    """A run killed while saving left a truncated state.safetensors (a traceback on --resume) or new weights
    beside the previous epoch's state.json. The record now travels inside the one file, replaced whole;
    a broken file is a one-line error naming the state."""
    recipe = TrainRecipe(variant="layershuffle", epochs=1, lr=3e-3, warmup_steps=5, batch_size=64)
    model, _ = build_model(easy_data, "layershuffle", None, ARCH, seed=0)
    Trainer(model, easy_data, recipe, torch.device("cpu"), tmp_path / "state").fit()
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["state.json", "state.safetensors"]
    (tmp_path / "state" / "state.json").write_text("{")  # a record torn apart: not the one read
    again, _ = build_model(easy_data, "layershuffle", None, ARCH, seed=1)
    resumed = Trainer(again, easy_data, recipe, torch.device("cpu"), tmp_path / "state")
    assert resumed.load_state() and resumed.epoch == 1
    state = tmp_path / "state" / "state.safetensors"
    state.write_bytes(state.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"cannot resume from .*state: its train state is unreadable"):
        Trainer(again, easy_data, recipe, torch.device("cpu"), tmp_path / "state").load_state()


def test_an_out_that_cannot_be_written_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only --out failed once the first epoch's train state was saved. os.access stands in for the
    read-only mount: tests may run as root, for whom a chmod changes nothing."""
    from layerswarm.training import runs

    monkeypatch.setattr(runs.os, "access", lambda path, mode: Path(path) != tmp_path)
    argv = ["train", "--data", "shapes1:32:8", "--epochs", "1", "--depth", "1", "--dim", "16", "--heads", "2"]
    assert main([*argv, "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'm'}: cannot write the model directory there ({tmp_path} is not writable)" in err
    assert "epoch 1" not in err and "Traceback" not in err and not (tmp_path / "m").exists()


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
    # The ensemble runs in as many random orders as a model does; its margin over the best member is
    # the mean of the per-image differences, inside its own paired bootstrap interval.
    assert group["ensemble_orders"]["n"] == 10
    assert group["ensemble"] == pytest.approx(group["ensemble_orders"]["mean"])
    lo, hi = group["ensemble_minus_best_member_ci95"]
    assert lo <= group["ensemble_minus_best_member"] <= hi
    assert group["ensemble_minus_best_member"] == pytest.approx(group["ensemble"] - group["best_member_arbitrary"])
    assert (tmp_path / "plots" / "accuracy_vs_blocks.png").stat().st_size > 1000
    assert "| member | layershuffle |" in capsys.readouterr().out
    assert main(["eval", str(member)]) == 0  # no --json: the report still goes to stdout
    assert "| member | layershuffle |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "flag", "problem"),
    [
        (["train", "--data", "shapes:0:0"], "--data", "at least 2 training and 1 test image"),
        (["train", "--data", "shapes:abc"], "--data", "whole-number counts"),
        (["train", "--data", "mnist"], "--data", "unknown data spec 'mnist'"),
        (["train", "--data", "imagefolder:/no/such/dir"], "--data", "is not a directory"),
        (["train", "--data", "shapes:64:16", "--batch-size", "0"], "--batch-size", "must be at least 1, got 0"),
        (["train", "--data", "shapes:64:16", "--epochs", "0"], "--epochs", "must be at least 1, got 0"),
        (["train", "--data", "shapes:64:16", "--image-size", "x"], "--image-size", "'x' is not a whole number"),
        (["train", "--data", "shapes", "--variant", "nope"], "--variant", "invalid choice"),
        (["train", "--data", "shapes", "--lr", "-1"], "--lr", "must be a finite number above 0, got -1"),
        (["train", "--data", "shapes", "--lr", "0"], "--lr", "must be a finite number above 0, got 0"),
        (["train", "--data", "shapes", "--weight-decay", "-0.1"], "--weight-decay", "at least 0, got -0.1"),
        (["train", "--data", "shapes", "--exit-loss", "nan"], "--exit-loss", "must be a finite number, got nan"),
        (["train", "--data", "shapes", "--time-budget", "0"], "--time-budget", "above 0, got 0"),
        (["train", "--data", "shapes", "--data-seed", "-1"], "--data-seed", "must be at least 0, got -1"),
        (["eval", "some-model", "--orders", "2"], "--orders", "must be at least 10, got 2"),
        (["eval", "some-model", "--merges", "5"], "--merges", "must be at least 20, got 5"),
    ],
)
def test_operator_mistakes_get_one_line_naming_the_flag(
    argv: list[str], flag: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if argv[0] == "train":
        argv = [*argv, "--out", str(tmp_path / "never")]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and f"argument {flag}: " in error_lines[0] and problem in error_lines[0], err
    assert "Traceback" not in err and not (tmp_path / "never").exists()


def test_cli_refuses_bad_init(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        main(["train", "--data", "shapes1:64:16", "--init", str(tmp_path / "missing"), "--out", str(tmp_path / "y")])
        == 2
    )
    assert "manifest" in capsys.readouterr().err


def test_trainer_talks_per_epoch_summary_and_near_chance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Two epochs on 200 images of 10 classes with lr 1e-6: the model stays at chance (0.05 with seed 1:
    fixed seeds, deterministic on CPU), and says so."""
    argv = ["train", "--data", "shapes1:200:20", "--epochs", "2", "--depth", "2", "--dim", "16", "--heads", "2"]
    assert main([*argv, "--lr", "1e-6", "--seed", "1", "--image-size", "16", "--out", str(tmp_path / "m")]) == 0
    err = capsys.readouterr().err
    epoch_lines = [line for line in err.splitlines() if line.startswith("epoch ") and "val acc" in line]
    assert [line.split(":")[0] for line in epoch_lines] == ["epoch 1/2", "epoch 2/2"], err
    assert all("sequential /" in line and "arbitrary order" in line and "s/step" in line for line in epoch_lines)
    assert "| epoch | train loss | val loss | val acc (sequential) | val acc (arbitrary order) |" in err
    assert err.count("| best |") == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("within 5 points of chance (0.100 for 10 classes)" in w for w in warnings), warnings
    manifest = read_manifest(tmp_path / "m")
    assert manifest.config.image_size == 16 and manifest.dataset["image_size"] == 16
    history = manifest.recipe["history"]
    assert len(history) == 2 and {"val_acc", "val_acc_arbitrary", "step_s", "peak_rss_mb"} <= set(history[0])


def test_no_chance_warning_for_a_model_that_learned(tmp_path: Path) -> None:
    from layerswarm.training.train_report import near_chance_warning

    learned = [{"epoch": 1, "val_loss": 0.3, "val_acc": 0.9, "val_acc_arbitrary": 0.12}]
    assert near_chance_warning(learned, 10, shuffle_robust=False) is None
    assert near_chance_warning(learned, 10, shuffle_robust=True) is not None  # arbitrary order is what it serves
    assert near_chance_warning([{**learned[0], "val_acc_arbitrary": 0.2}], 10, shuffle_robust=True) is None


def test_unequal_classes_warn_when_the_model_is_not_above_the_most_common_class() -> None:
    """161 images, 150 of one class: a model that only ever answers it scores 0.93, far above chance
    (0.33), and was reported as learned with no word."""
    from layerswarm.training.train_report import below_majority_warning

    kept = [{"epoch": 1, "val_loss": 0.5, "val_acc": 0.93, "val_acc_arbitrary": 0.93}]
    warning = below_majority_warning(kept, 0.93, "big", 3, shuffle_robust=True)
    assert warning and "most common class 'big' (0.930 of the validation images)" in warning
    better = [{**kept[0], "val_acc": 0.99, "val_acc_arbitrary": 0.99}]
    assert below_majority_warning(better, 0.93, "big", 3, shuffle_robust=True) is None
    assert below_majority_warning(kept, 0.35, "a", 3, shuffle_robust=True) is None  # equal classes: chance speaks


def test_image_size_must_match_the_init_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--data", "shapes1:32:8", "--epochs", "1", "--depth", "1", "--dim", "16", "--heads", "2"]
    assert main(["train", *common, "--image-size", "16", "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    bad = ["train", *common, "--init", str(tmp_path / "a"), "--image-size", "32", "--out", str(tmp_path / "b")]
    assert main(bad) == 2
    assert "--image-size 32 does not match the --init model's image size 16" in capsys.readouterr().err
    assert main(["train", *common, "--init", str(tmp_path / "a"), "--out", str(tmp_path / "c")]) == 0
    assert read_manifest(tmp_path / "c").config.image_size == 16  # the size follows the init model
    capsys.readouterr()
    assert main(["train", *common, "--image-size", "20", "--patch-size", "8", "--out", str(tmp_path / "d")]) == 2
    assert "--image-size 20 is not a multiple of --patch-size 8" in capsys.readouterr().err


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


def test_plots_draw_the_chance_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from layerswarm.training.evaluation import plots

    figures: list = []  # type: ignore[type-arg]
    monkeypatch.setattr(plots.plt, "close", figures.append)
    row = {
        "variant": "layershuffle",
        "pruned": {"1": {"sequential": 0.5, "arbitrary": 0.4}},
        "arbitrary": {"mean": 0.4},
    }
    group = {"variant": "layershuffle", "members": ["a"], "merged": {"mean": 0.4, "std": 0.0}, "ensemble": 0.5}
    report = {
        "chance": 0.25,
        "dataset": {"classes": ["w", "x", "y", "z"]},
        "models": {"a": row},
        "groups": {"f/l": group},
    }
    plots.plot_pruning(report, tmp_path / "p.png")
    plots.plot_merged(report, tmp_path / "m.png")
    for fig in figures:
        for ax in fig.axes:
            flat = [line for line in ax.get_lines() if set(line.get_ydata()) == {0.25}]
            assert flat and "chance" in flat[0].get_label()


def test_resume_reads_a_setting_added_later_as_its_default(data, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A run saved before a recipe field existed resumes; a real change of recipe is refused, named."""
    recipe = TrainRecipe(variant="layershuffle", epochs=1, warmup_steps=2, batch_size=64)
    model, _ = build_model(data, "layershuffle", None, ARCH, seed=0)
    trainer = Trainer(model, data, recipe, torch.device("cpu"), tmp_path / "state")
    trainer.fit()
    trainer.save_state()
    state = tmp_path / "state" / "state.safetensors"
    meta, tensors = read_state(state)
    del meta["recipe"]["mixup"], meta["recipe"]["drop_path"]  # as saved by a version without them
    save_file(tensors, str(state), metadata={"meta": json.dumps(meta)})
    again, _ = build_model(data, "layershuffle", None, ARCH, seed=1)
    assert Trainer(again, data, recipe, torch.device("cpu"), tmp_path / "state").load_state()

    changed = TrainRecipe(variant="layershuffle", epochs=1, warmup_steps=2, batch_size=64, mixup=0.2)
    with pytest.raises(ValueError, match=r"mixup: 0.0 -> 0.2"):
        Trainer(again, data, changed, torch.device("cpu"), tmp_path / "state").load_state()


def test_a_resume_reads_the_time_budget_its_run_started_with(easy_data: Dataset, tmp_path: Path) -> None:
    """The default budget grows with the data since 2026-11-27: a run started before, resumed without
    --time-budget, goes on with its own (read here) instead of being refused for a budget it never asked."""
    recipe = TrainRecipe(variant="layershuffle", epochs=1, warmup_steps=2, batch_size=64, time_budget_s=77.0)
    model, _ = build_model(easy_data, "layershuffle", None, ARCH, seed=0)
    Trainer(model, easy_data, recipe, torch.device("cpu"), tmp_path / "state").fit()
    assert saved_time_budget(tmp_path / "state") == 77.0
    assert saved_time_budget(tmp_path / "none") is None
    (tmp_path / "state" / "state.safetensors").write_bytes(b"torn")
    assert saved_time_budget(tmp_path / "state") is None  # unreadable: load_state names it


def test_a_validation_split_too_small_to_mean_anything_is_named(
    easy_data: Dataset, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """51 validation images (10% of 512) pass quietly; 12 of 128 are said to be noise."""
    recipe = TrainRecipe(variant="layershuffle", epochs=1)
    model, _ = build_model(easy_data, "layershuffle", None, ARCH, seed=0)
    with caplog.at_level("WARNING"):
        Trainer(model, easy_data, recipe, torch.device("cpu"), tmp_path)
    assert not [r for r in caplog.records if "validation split" in r.getMessage()]
    few = Dataset(
        "colours",
        "few",
        easy_data.train_x[:128],
        easy_data.train_y[:128],
        easy_data.test_x,
        easy_data.test_y,
        easy_data.class_names,
    )
    with caplog.at_level("WARNING"):
        Trainer(model, few, recipe, torch.device("cpu"), tmp_path)
    (warning,) = [r.getMessage() for r in caplog.records if "validation split" in r.getMessage()]
    assert "holds 12 image(s)" in warning and "8 points" in warning


def test_the_validation_split_follows_the_split_seed_not_the_training_seed(data, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Family members train with seeds of their own on their base's split (`layerswarm family` passes it):
    the split must not move with the training seed, or a member validates on images its base trained on."""
    model, _ = build_model(data, "layershuffle", None, ARCH, seed=0)

    def val_idx(**seeds: int) -> list[int]:
        recipe = TrainRecipe(variant="layershuffle", epochs=1, **seeds)  # type: ignore[arg-type]
        return sorted(Trainer(model, data, recipe, torch.device("cpu"), tmp_path / str(seeds)).val_idx.tolist())

    base = val_idx(seed=0)
    assert val_idx(seed=5, split_seed=0) == base
    assert val_idx(seed=5) != base  # without it, the split is the training seed's (a base's own run)
    # The one rule the reference CNN of a screen (bench.reference_cnn) splits by too.
    assert sorted(validation_split(data.train_y, TrainRecipe.val_fraction, 5, 0)[0].tolist()) == base


def test_bootstrap_resamples_the_training_split_only_one_resample_per_seed(data, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`--bootstrap`: as many draws as the training split holds, with replacement, from it alone (the
    validation images stay unseen), the same for a seed and different across seeds (family members)."""
    model, _ = build_model(data, "layershuffle", None, ARCH, seed=0)

    def trainer(seed: int, bootstrap: bool) -> Trainer:
        recipe = TrainRecipe(variant="layershuffle", epochs=1, seed=seed, split_seed=0, bootstrap=bootstrap)
        return Trainer(model, data, recipe, torch.device("cpu"), tmp_path / f"{seed}-{bootstrap}")

    plain, first, again, other = trainer(1, False), trainer(1, True), trainer(1, True), trainer(2, True)
    drawn = first.train_idx.tolist()
    assert len(drawn) == len(plain.train_idx) and len(set(drawn)) < len(drawn)  # with replacement
    assert set(drawn) <= set(plain.train_idx.tolist()) and not set(drawn) & set(first.val_idx.tolist())
    assert drawn == again.train_idx.tolist() and drawn != other.train_idx.tolist()
    assert first.steps_per_epoch == plain.steps_per_epoch


def test_weight_decay_is_decoupled_and_shrinks_only_the_weight_matrices(data) -> None:  # type: ignore[no-untyped-def]
    """With zero gradients, decoupled decay (AdamW) scales each matrix by exactly 1 - lr x wd; Adam's L2
    would have moved it by about lr per element instead. Biases, norms, the position embedding and the
    class token are not decayed."""
    from layerswarm.training.train import make_optimizer

    model, _ = build_model(data, "layershuffle", None, ARCH, seed=0)
    recipe = TrainRecipe(lr=0.1, weight_decay=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_optimizer(model, recipe)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        matrix = p.ndim >= 2 and not name.endswith(("pos_embed", "cls_token"))
        expected = before[name] * (1 - 0.1 * 0.5) if matrix else before[name]
        assert torch.allclose(p, expected, atol=1e-7), name
    assert {"blocks.0.attn.qkv.weight", "head.classifier.weight"} <= {
        n for n, p in model.named_parameters() if p.ndim >= 2
    }
    assert len(make_optimizer(model, TrainRecipe()).param_groups) == 1  # no decay: as every earlier run


def test_a_weight_decay_state_from_before_decoupling_is_refused_not_resumed(easy_data: Dataset, tmp_path: Path) -> None:
    """A run with --weight-decay saved before it became AdamW's (one parameter group, Adam's L2) would go
    on with another optimiser halfway; --resume names that instead (here: its record, made one-group)."""
    recipe = TrainRecipe(variant="layershuffle", epochs=1, lr=3e-3, warmup_steps=5, batch_size=64, weight_decay=0.05)
    model, _ = build_model(easy_data, "layershuffle", None, ARCH, seed=0)
    Trainer(model, easy_data, recipe, torch.device("cpu"), tmp_path / "state").fit()
    path = tmp_path / "state" / "state.safetensors"
    meta, tensors = read_state(path)
    assert Trainer(model, easy_data, recipe, torch.device("cpu"), tmp_path / "state").load_state()  # as saved: fine
    meta["sched"]["base_lrs"] = meta["sched"]["base_lrs"][:1]
    save_file(tensors, str(path), metadata={"meta": json.dumps(meta)})
    with pytest.raises(ValueError, match=r"cannot resume from .*: its optimiser state is from an earlier version"):
        Trainer(model, easy_data, recipe, torch.device("cpu"), tmp_path / "state").load_state()
