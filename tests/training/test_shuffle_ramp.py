"""The shuffle ramp (`train --shuffle-ramp`): in-order batches giving way to shuffled ones over a share of
the step schedule, the kept model chosen only after it, and who gets a ramp by default."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from layerswarm.bench.own_data import kept_record
from layerswarm.cli import main
from layerswarm.cli.train import recipe_from_args
from layerswarm.training.data.datasets import Dataset
from layerswarm.training.learned import kept_accuracies
from layerswarm.training.objective import batch_order
from layerswarm.training.recipe import FROM_SCRATCH_SHUFFLE_RAMP
from layerswarm.training.train import Trainer, TrainRecipe, build_model
from layerswarm.training.train_report import best_epoch, near_chance_warning

from ..colour_data import colour_dataset

ARCH = {"depth": 4, "dim": 16, "heads": 2, "patch_size": 8}


@pytest.fixture(scope="module")
def colours() -> Dataset:
    return colour_dataset(320, train=256)


def test_the_chance_of_a_shuffled_batch_decides_between_in_order_and_a_random_order(colours: Dataset) -> None:
    model, _ = build_model(colours, "layershuffle", None, ARCH, seed=0)
    gen = torch.Generator().manual_seed(0)
    assert all(batch_order(model, "layershuffle", gen, 0.0) == [0, 1, 2, 3] for _ in range(20))
    half = [batch_order(model, "layershuffle", gen, 0.5) for _ in range(200)]
    in_order = sum(order == [0, 1, 2, 3] for order in half)
    assert 70 <= in_order <= 140  # about half in order, plus the random orders that happen to be (1 in 24)
    assert batch_order(model, "baseline", gen, 0.5) == [0, 1, 2, 3]


def test_without_a_ramp_the_orders_drawn_are_the_ones_always_drawn(colours: Dataset) -> None:
    """No extra draw when every batch is shuffled: runs and resumes from before the ramp stay exact."""
    model, _ = build_model(colours, "layershuffle", None, ARCH, seed=0)
    gen, same = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    drawn = [batch_order(model, "layershuffle", gen) for _ in range(10)]
    assert drawn == [torch.randperm(4, generator=same).tolist() for _ in range(10)]


def trainer(data: Dataset, tmp_path: Path, ramp: float, epochs: int = 4) -> Trainer:
    model, _ = build_model(data, "layershuffle", None, ARCH, seed=0)
    recipe = TrainRecipe(epochs=epochs, batch_size=64, warmup_steps=1, shuffle_ramp=ramp, time_budget_s=1e6)
    return Trainer(model, data, recipe, torch.device("cpu"), tmp_path / "state")


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step:UserWarning")  # stepped alone on purpose
def test_the_chance_rises_over_the_ramp_share_of_the_schedule(colours: Dataset, tmp_path: Path) -> None:
    run = trainer(colours, tmp_path, ramp=0.5)  # 4 steps an epoch, 16 in all: shuffled from step 8
    chances = []
    for _ in range(run.total_steps):
        chances.append(run.shuffle_chance())
        run.sched.step()
    assert chances[0] == 0.0 and chances[4] == pytest.approx(0.5) and chances[8:] == [1.0] * 8
    assert trainer(colours, tmp_path / "none", ramp=0.0).shuffle_chance() == 1.0


def test_the_kept_model_is_chosen_after_the_ramp_not_during_it(colours: Dataset, tmp_path: Path) -> None:
    """During the ramp the validation loss is in-order accuracy: a model kept then could fail in the orders
    the swarm runs it in. A ramp over the whole schedule keeps no earlier epoch and counts no patience."""
    whole = trainer(colours, tmp_path / "whole", ramp=1.0)
    whole.fit()
    assert whole.best_state is None and whole.stale == 0 and len(whole.history) == 4
    half = trainer(colours, tmp_path / "half", ramp=0.5)
    half.fit()
    assert half.best_state is not None  # chosen once the ramp is over, from the end of epoch 2 on
    assert [r["kept"] for r in whole.history] == [0.0] * 4 and best_epoch(whole.history) == 4  # its last weights
    assert [r["kept"] for r in half.history[:1]] == [0.0] and best_epoch(half.history) in (2, 3, 4)
    kept = next(r for r in half.history if r["epoch"] == best_epoch(half.history))
    assert kept["kept"] == 1.0 and kept_accuracies(half)["val_sequential"] == kept["val_acc"]


def test_the_reports_name_the_epoch_the_trainer_kept_not_the_lowest_in_order_loss() -> None:
    """An in-order batch lowers the in-order validation loss: during a ramp the lowest loss is often an
    epoch the trainer never keeps. The table's `best`, the near-chance warning and the reference ratio
    read the trainer's mark (they read the lowest loss, so a ramp run's ratio was a ramp epoch's)."""

    def epoch(n: int, loss: float, acc: float, kept: float | None) -> dict[str, float]:
        record = {"epoch": n, "val_loss": loss, "val_acc": acc, "val_acc_arbitrary": acc}
        return record if kept is None else {**record, "kept": kept}

    ramp_then_kept = [epoch(1, 0.3, 0.9, 0.0), epoch(2, 0.5, 0.27, 1.0), epoch(3, 0.6, 0.2, 0.0)]
    assert best_epoch(ramp_then_kept) == 2
    assert near_chance_warning(ramp_then_kept, 4, shuffle_robust=True)  # the kept 0.27 is near chance, 0.9 not
    assert best_epoch([epoch(1, 0.3, 0.9, 0.0), epoch(2, 0.5, 0.3, 0.0)]) == 2  # none kept: the last weights
    assert best_epoch([epoch(1, 0.5, 0.3, None), epoch(2, 0.3, 0.9, None)]) == 2  # a history from before the mark


def args_for(init: str | None, asked: float | None) -> argparse.Namespace:
    fields = ("variant", "epochs", "batch_size", "lr", "weight_decay", "warmup_steps", "seed", "split_seed")
    fields += ("threads", "exit_loss", "bootstrap", "time_budget_s", "patience", "label_smoothing")
    values = {name: getattr(TrainRecipe(), name) for name in (*fields, "drop_path", "mixup")}
    return argparse.Namespace(**values, init=init, shuffle_ramp=asked)


def test_a_model_from_scratch_ramps_by_default_a_fine_tune_does_not_and_an_asked_share_wins() -> None:
    assert recipe_from_args(args_for(None, None)).shuffle_ramp == FROM_SCRATCH_SHUFFLE_RAMP
    assert recipe_from_args(args_for("models/base", None)).shuffle_ramp == 0.0
    assert recipe_from_args(args_for("models/base", 0.3)).shuffle_ramp == 0.3
    assert recipe_from_args(args_for(None, 0.0)).shuffle_ramp == 0.0


def test_a_share_outside_0_to_1_is_a_usage_error_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--data", "shapes", "--out", str(tmp_path / "m"), "--shuffle-ramp", "1.5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--shuffle-ramp" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()


def test_the_bench_table_rebuilds_the_kept_epoch_of_a_ramp_run_from_before_the_mark() -> None:
    """Ramp runs made before the trainer marked its kept epoch are read back as the trainer chose: the
    lowest loss once the ramp was over (10 steps an epoch, 40 planned, a half ramp: over after epoch 2)."""
    history = [
        {"epoch": n, "val_loss": loss, "seconds": 1.0, "step_s": 0.1, "planned_steps": 40}
        for n, loss in ((1, 0.1), (2, 0.5), (3, 0.4), (4, 0.6))
    ]
    assert kept_record({"history": history, "shuffle_ramp": 0.5})["epoch"] == 3
    assert kept_record({"history": history, "shuffle_ramp": 0.0})["epoch"] == 1
    marked = [{**h, "kept": float(h["epoch"] == 2)} for h in history]
    assert kept_record({"history": marked, "shuffle_ramp": 0.5})["epoch"] == 2
