"""A training run's resumable state: weights, best weights, optimizer and RNG state in one safetensors
file, its record (epoch, schedule, recipe, data and model) in the file's metadata. Nothing is ever
unpickled, and a state of another recipe, other data or another model is refused, naming what changed."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from layerswarm.models.vit import ViT

from .data.datasets import Dataset
from .recipe import TrainRecipe, recipe_changes
from .train_report import EpochRecord

log = logging.getLogger("layerswarm.training.train")

TRAIN_STATE = ".train_state"  # OUT/.train_state: a run's resumable state, saved after every epoch
STATE_FILE = "state.safetensors"


class Resumable(Protocol):
    """A run as its state is saved and restored (the Trainer, train.py): stated here, so the state
    needs nothing from the trainer that saves it."""

    state_dir: Path
    model: ViT
    data: Dataset
    recipe: TrainRecipe
    device: torch.device
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    gen: torch.Generator
    best_state: dict[str, Tensor] | None
    history: list[EpochRecord]
    epoch: int
    best_val: float
    stale: int
    total_steps: int
    planned: bool


def save_state(trainer: Resumable) -> None:
    """Write the run so far; a run killed mid-write leaves the previous state whole."""
    trainer.state_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in trainer.model.state_dict().items()}
    if trainer.best_state is not None:
        tensors.update({f"best.{k}": v.cpu().contiguous() for k, v in trainer.best_state.items()})
    for i, param in enumerate(trainer.model.parameters()):
        for key, value in trainer.opt.state.get(param, {}).items():
            tensors[f"opt.{i}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tensors["rng"] = trainer.gen.get_state()
    meta = {
        "epoch": trainer.epoch,
        "best_val": trainer.best_val,
        "stale": trainer.stale,
        "planned_steps": trainer.total_steps if trainer.planned else None,
        "history": trainer.history,
        "sched": trainer.sched.state_dict(),
        "recipe": asdict(trainer.recipe),
        **_made_with(trainer),
    }
    text = json.dumps(meta, indent=1)
    # One file holds the weights and their record (safetensors metadata) and replaces the last one whole:
    # a run killed while saving left a truncated file (a traceback on --resume), and one interrupted
    # between two files the weights of one epoch beside the record of the one before. state.json is the
    # same record, for people; it is read only for states written before the record moved in.
    partial = trainer.state_dir / (STATE_FILE + ".partial")
    save_file(tensors, str(partial), metadata={"meta": text})
    os.replace(partial, trainer.state_dir / STATE_FILE)
    (trainer.state_dir / "state.json").write_text(text)


def _made_with(trainer: Resumable) -> dict[str, Any]:
    """The data and model a train state belongs to, as JSON reads them back. Without them, --resume
    with another --data of as many classes silently went on training the other data's weights, and
    one with another class count or --dim stopped in a traceback."""
    data = {k: v for k, v in trainer.data.describe().items() if k != "streamed"}  # streaming: a memory limit
    return json.loads(json.dumps({"data": data, "model": trainer.model.cfg.to_dict()}))


def saved_time_budget(state_dir: Path) -> float | None:
    """The time budget of the run a train state in `state_dir` was saved from (None: no readable state,
    which load_state then names): a --resume without --time-budget goes on with it, as the run started,
    though the data-derived default may have changed since."""
    path = state_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        recipe = read_state_record(path)["recipe"]
    except (OSError, ValueError, KeyError, SafetensorError):
        return None
    budget = recipe.get("time_budget_s") if isinstance(recipe, dict) else None
    return float(budget) if isinstance(budget, int | float) else None


def load_state(trainer: Resumable) -> bool:
    path = trainer.state_dir / STATE_FILE
    if not path.is_file():
        return False
    try:
        meta, tensors = read_state(path)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise ValueError(
            f"cannot resume from {trainer.state_dir}: its train state is unreadable ({exc}); "
            "train without --resume to start over"
        ) from None
    changes = recipe_changes(meta["recipe"], trainer.recipe)
    if changes:
        raise ValueError(
            f"cannot resume from {trainer.state_dir}: it was made with another recipe ({'; '.join(changes)}); "
            "run the same command as before, or train into a new --out"
        )
    for key, now in _made_with(trainer).items():
        saved = meta.get(key, now)  # states written before these were recorded are not checked
        changed = sorted(k for k in {*saved, *now} if saved.get(k) != now.get(k))
        if changed:
            shown = "; ".join(f"{k} {saved.get(k)!r}, now {now.get(k)!r}" for k in changed[:3])
            raise ValueError(
                f"cannot resume from {trainer.state_dir}: it was made with other {key} ({shown}); "
                "use another --out, or train without --resume to start over there"
            )
    if len(meta["sched"].get("base_lrs", [])) != len(trainer.opt.param_groups):
        # Written before --weight-decay became decoupled and matrices-only (one group; Adam's L2 then):
        # going on would change the optimiser halfway through the run.
        raise ValueError(
            f"cannot resume from {trainer.state_dir}: its optimiser state is from an earlier version (weight "
            "decay was Adam's L2 then); train without --resume to start over"
        )
    trainer.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    best = {k[5:]: v for k, v in tensors.items() if k.startswith("best.")}
    trainer.best_state = best or None
    for i, param in enumerate(trainer.model.parameters()):
        state = {k.split(".", 2)[2]: v.to(trainer.device) for k, v in tensors.items() if k.startswith(f"opt.{i}.")}
        if state:
            trainer.opt.state[param] = state
    trainer.gen.set_state(tensors["rng"])
    trainer.sched.load_state_dict(meta["sched"])
    for group, lr in zip(trainer.opt.param_groups, trainer.sched.get_last_lr(), strict=True):
        group["lr"] = lr  # the optimiser's rate is not in its saved state: the next step's comes from the schedule
    trainer.epoch, trainer.best_val, trainer.history = meta["epoch"], meta["best_val"], meta["history"]
    trainer.stale = int(meta.get("stale", 0))
    if meta.get("planned_steps"):
        trainer.total_steps, trainer.planned = int(meta["planned_steps"]), True
    log.info("resumed from %s at epoch %d", trainer.state_dir, trainer.epoch)
    return True


def read_state(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A train state's record and tensors."""
    return read_state_record(path), load_file(str(path))


def read_state_record(path: Path) -> dict[str, Any]:
    """A train state's record alone (the file's header, not its tensors): from the file's own metadata,
    else (states written before it moved in) from state.json beside it."""
    with safe_open(str(path), framework="pt") as f:
        text = (f.metadata() or {}).get("meta")
    meta = json.loads(text if text is not None else (path.parent / "state.json").read_text())
    if not isinstance(meta, dict) or "recipe" not in meta:
        raise ValueError("no training record in it")
    return meta
