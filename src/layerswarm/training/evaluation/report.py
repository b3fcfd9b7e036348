"""The evaluation report (`layerswarm eval --json`): its records, and the same report as markdown tables.

EvalReport
  dataset        the data's description
  plan, chance   how it was measured (absent from a calibration-only report)
  models         name -> ModelRow: accuracy in order, over random orders, pruned to k blocks
  groups         family/variant -> GroupRow: merged models and the ensemble of two or more members
  targets        name -> the checks of check_targets (evaluate.py)
  calibration    name -> the adaptive-compute calibration of that model (adaptive.py)
"""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from ..data.datasets import DataRecord
from .adaptive import CalibrationRecord


class Summary(TypedDict):
    """Figures over random orders, merges or members."""

    mean: float
    std: float
    min: float
    max: float
    n: int


class Pruned(TypedDict):
    sequential: float  # the blocks paths.spread_evenly keeps, in order
    arbitrary: float  # random subsets of that many blocks, in random order


class ModelRow(TypedDict):
    model_id: str
    family_id: str
    variant: str
    sequential: float
    arbitrary: Summary
    pruned: dict[str, Pruned]  # blocks kept (as a string: a JSON key) -> accuracy


class GroupRow(TypedDict):
    family_id: str
    variant: str
    members: list[str]
    sequential: float  # the members' mean
    arbitrary: Summary  # over the members' means
    pruned: dict[str, Pruned]  # the members' mean
    merged: Summary  # random merges, in random order
    merged_sequential: Summary
    ensemble: float  # mean logits of the members, each in its own random order
    ensemble_orders: NotRequired[Summary]
    ensemble_sequential: float
    best_member: str
    best_member_arbitrary: float
    ensemble_minus_best_member: float
    ensemble_minus_best_member_ci95: NotRequired[list[float]]  # reports before the interval existed lack it


class PlanRecord(TypedDict):
    orders: int
    merges: int
    prune_trials: int
    seed: int


# A check's value: a ratio or difference, a verdict, a yes/no, or a 95% interval.
Check = float | bool | str | list[float]


class EvalReport(TypedDict):
    dataset: DataRecord
    plan: NotRequired[PlanRecord]
    chance: NotRequired[float]
    models: dict[str, ModelRow]
    groups: dict[str, GroupRow]
    targets: NotRequired[dict[str, dict[str, Check]]]
    calibration: NotRequired[dict[str, CalibrationRecord]]


def render_table(report: EvalReport) -> str:
    """The report as markdown: accuracy per model and group, pruning, and the targets."""
    lines = ["| model | variant | sequential | arbitrary order (mean ± std) |", "| --- | --- | --- | --- |"]
    for name, m in report["models"].items():
        a = m["arbitrary"]
        lines.append(f"| {name} | {m['variant']} | {m['sequential']:.4f} | {a['mean']:.4f} ± {a['std']:.4f} |")
    for g in report["groups"].values():
        n = len(g["members"])
        merged, merged_seq = g["merged"], g["merged_sequential"]
        lines.append(
            f"| merged, {merged['n']} random merges of {n} members | {g['variant']} | "
            f"{merged_seq['mean']:.4f} | {merged['mean']:.4f} ± {merged['std']:.4f} |"
        )
        spread = f" ± {g['ensemble_orders']['std']:.4f}" if "ensemble_orders" in g else ""
        lines.append(
            f"| ensemble of {n} members (mean logits) | {g['variant']} | {g['ensemble_sequential']:.4f} | "
            f"{g['ensemble']:.4f}{spread} |"
        )
    lines += ["", _render_pruning(report)]
    if report.get("targets"):
        lines += ["", _render_targets(report["targets"])]
    return "\n".join(lines)


def _render_pruning(report: EvalReport) -> str:
    rows = {name: m["pruned"] for name, m in report["models"].items()}
    ks = sorted({int(k) for pruned in rows.values() for k in pruned})
    head = "| blocks kept: sequential / arbitrary | " + " | ".join(str(k) for k in ks) + " |"
    lines = [head, "| --- |" + " --- |" * len(ks)]
    for name, pruned in rows.items():
        cells = [f"{pruned[str(k)]['sequential']:.2f} / {pruned[str(k)]['arbitrary']:.2f}" for k in ks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _render_targets(targets: dict[str, dict[str, Check]]) -> str:
    lines = ["| check | value |", "| --- | --- |"]
    for key, checks in targets.items():
        for name, value in checks.items():
            if isinstance(value, list):  # an interval
                shown = "[" + ", ".join(f"{v:+.4f}" for v in value) + "] (95%)"
            else:
                shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            lines.append(f"| {key.split('/')[-1]}: {name} | {shown} |")
    return "\n".join(lines)
