"""What the trainer tells its operator: a line per epoch, a table at the end, a warning near chance."""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence
from typing import TypedDict

import torch

# A model within this many accuracy points of chance has learned next to nothing: say so.
NEAR_CHANCE_POINTS = 0.05


class EpochRecord(TypedDict, total=False):
    """One epoch of a run's history (the trainer's, the train state's, the manifest's recipe.history).
    Histories written before a key existed lack it; `kept` marks the epoch whose weights were kept."""

    epoch: int
    train_loss: float
    peak_rss_mb: float  # the process's resident set
    peak_cuda_mb: float  # tensors on the device (CUDA only)
    seconds: float
    step_s: float
    step_cpu_s: float  # CPU seconds of this process per step (all its threads)
    val_loss: float
    val_acc: float
    val_acc_arbitrary: float
    val_exit_objective: float  # --exit-loss: the objective trained, on the validation split (what is kept by)
    planned_steps: int
    kept: float  # 1.0: this epoch's weights became the kept ones


def peak_memory_mb(device: torch.device) -> EpochRecord:
    """Peak memory so far (an epoch record's memory part): the process's resident set (always) and, on
    CUDA, tensors on the device."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    scale = 1024 if sys.platform != "darwin" else 1  # macOS reports bytes
    out: EpochRecord = {"peak_rss_mb": round(peak_kib * scale / 2**20, 1)}
    if device.type == "cuda":
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


def describe_epoch(record: EpochRecord, epochs: int) -> str:
    memory = f"peak RSS {record['peak_rss_mb']:.0f} MB"
    if "peak_cuda_mb" in record:
        memory += f", peak CUDA {record['peak_cuda_mb']:.0f} MB"
    objective = f" (exit objective {record['val_exit_objective']:.4f})" if "val_exit_objective" in record else ""
    return (
        f"epoch {int(record['epoch'])}/{epochs}: train loss {record['train_loss']:.4f}, "
        f"val loss {record['val_loss']:.4f}{objective}, val acc {record['val_acc']:.4f} sequential / "
        f"{record['val_acc_arbitrary']:.4f} arbitrary order; {record['step_s']:.3f} s/step, {memory}"
    )


def render_history(history: Sequence[EpochRecord], best_epoch: int | None) -> str:
    """The run as a markdown table, the kept (best validation) epoch marked."""
    lines = [
        "| epoch | train loss | val loss | val acc (sequential) | val acc (arbitrary order) | s/step | kept |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in history:
        kept = "best" if int(r["epoch"]) == best_epoch else ""
        lines.append(
            f"| {int(r['epoch'])} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | {r['val_acc']:.4f} | "
            f"{r['val_acc_arbitrary']:.4f} | {r['step_s']:.3f} | {kept} |"
        )
    return "\n".join(lines)


def kept_by(record: EpochRecord) -> float:
    """The validation figure a run keeps its weights by: the objective trained where it differs from the
    last block's loss in order (--exit-loss), else that loss."""
    return record.get("val_exit_objective", record["val_loss"])


def best_epoch(history: Sequence[EpochRecord]) -> int | None:
    """The epoch whose weights the trainer kept: the last it marked `kept`. An epoch of a shuffle ramp
    is never kept, however low its (in-order) validation loss; with none marked (a ramp over the whole
    run) the last epoch's weights are the model. A history from before the mark: the lowest loss."""
    if not history:
        return None
    if not any("kept" in r for r in history):
        return int(min(history, key=lambda r: r["val_loss"])["epoch"])
    kept = [r for r in history if r.get("kept")]
    return int((kept or history)[-1]["epoch"])


def kept_record(history: Sequence[EpochRecord]) -> EpochRecord | None:
    """The history record of the epoch whose weights the trainer kept (best_epoch's); None without history."""
    epoch = best_epoch(history)
    return None if epoch is None else next(r for r in history if int(r["epoch"]) == epoch)


def served_accuracy(record: EpochRecord, shuffle_robust: bool) -> tuple[float, str]:
    """An epoch's validation accuracy in the order the model will be served in, and that order's name."""
    if shuffle_robust:
        return record["val_acc_arbitrary"], "arbitrary-order"
    return record["val_acc"], "sequential"


def near_chance_warning(
    history: Sequence[EpochRecord], num_classes: int, shuffle_robust: bool, points: float = NEAR_CHANCE_POINTS
) -> str | None:
    """A warning when the kept epoch's validation accuracy (arbitrary order for shuffle-robust variants,
    the order they will be served in) is within `points` of chance; None otherwise."""
    record = kept_record(history)
    if record is None:
        return None
    accuracy, order = served_accuracy(record, shuffle_robust)
    chance = 1.0 / num_classes
    if accuracy > chance + points:
        return None
    return (
        f"warning: {order} validation accuracy {accuracy:.3f} is within {points * 100:.0f} points of chance "
        f"({chance:.3f} for {num_classes} classes): the model has learned little; train longer, with more "
        "data or another learning rate"
    )


def below_majority_warning(
    history: Sequence[EpochRecord],
    baseline: float,
    class_name: str,
    num_classes: int,
    shuffle_robust: bool,
    points: float = NEAR_CHANCE_POINTS,
) -> str | None:
    """A warning when the classes are so unequal that always answering the most common training class
    (`baseline`: its share of the validation images) is well above chance and the kept model is not
    `points` above it: chance (1 / classes) alone made a model that only ever said "big" look learned."""
    record = kept_record(history)
    if record is None or baseline <= 1.0 / num_classes + points:
        return None  # near_chance_warning speaks for balanced classes
    accuracy, order = served_accuracy(record, shuffle_robust)
    if accuracy > baseline + points:
        return None
    return (
        f"warning: {order} validation accuracy {accuracy:.3f} is not {points * 100:.0f} points above always "
        f"answering the most common class {class_name!r} ({baseline:.3f} of the validation images): the classes "
        "are very unequal and the model has learned little beyond that; add images of the smaller classes"
    )
