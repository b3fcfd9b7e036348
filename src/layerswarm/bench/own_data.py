"""The own-data comparison, summarised: what `scripts/own_data_check.sh` left in its work folder (one
TASK-N/ folder per generated dataset and size) as one JSON report and a markdown table.

Per folder: the bare default `layerswarm train` run (its manifest's `metrics.learned`: the ViT's
validation accuracy against chance and against the reference CNN trained on the same split for the
same wall-clock time), the test accuracy, what ended training, the time; and where the family part ran
(FAMILY=1), `layerswarm eval`'s targets for the LayerShuffle members and the conventional baseline.

    python -m layerswarm.bench.own_data WORK_DIR --json docs/results/own-data.json --markdown docs/results/own-data.md

With --runs, one row per model directory instead (a comparison of flags, such as scripts/own_data_check.sh's
SIZES ladder): the command, width and depth, test accuracy, the kept epoch, what ended training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import time
from pathlib import Path
from typing import Any

from layerswarm.training.evaluation.evaluate import COLLAPSED_AT, kept_above_chance
from layerswarm.training.size import block_params
from layerswarm.training.train_report import kept_record as kept_epoch_record

from . import emit_table

TARGET_RATIO = 0.9  # the ViT against the reference CNN, same split, same time

# Where the summary is written, which for these runs is where they trained (the runs record no machine).
MACHINE = f"{platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} cores, no GPU"


def summarize(work: Path) -> dict[str, Any]:
    rows = [row for folder in work.iterdir() if (row := _row(folder)) is not None]
    rows.sort(key=lambda r: (r["task"], r["train_images"] or 0))
    return {
        "work_dir": str(work),
        "machine": MACHINE,
        "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "target_ratio": TARGET_RATIO,
        "rows": rows,
    }


def _row(folder: Path) -> dict[str, Any] | None:
    manifest_path = folder / "base" / "manifest.json"
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    metrics, recipe = manifest["metrics"], manifest["recipe"]
    learned = metrics["learned"]
    times = json.loads((folder / "times.json").read_text()) if (folder / "times.json").is_file() else {}
    history = recipe.get("history", [])
    row: dict[str, Any] = {
        "task": times.get("task", folder.name.rsplit("-", 1)[0]),
        "train_images": times.get("train_images"),
        "command": recipe.get("command"),
        "chance": learned["chance"],
        "vit_val_sequential": learned["vit_val_sequential"],
        "vit_val_arbitrary": learned.get("vit_val_arbitrary"),
        "reference_val": learned["reference"]["val_acc"],
        "reference_steps": learned["reference"]["steps"],
        "reference_seconds": learned["reference"]["seconds"],
        "ratio_sequential": learned["ratio_val_sequential"],
        "ratio_arbitrary": learned.get("ratio_val_arbitrary"),
        "test_sequential": metrics.get("test_sequential"),
        "test_arbitrary": metrics.get("test_arbitrary"),
        "epochs": len(history),
        "training_seconds": round(sum(h.get("seconds", 0.0) for h in history), 1),
        "stopped": recipe.get("stopped"),
        "whole_run_seconds": times.get("base_s"),
        "met": learned["reference"]["val_acc"] == 0 or learned["ratio_val_sequential"] >= TARGET_RATIO,
    }
    report_path = folder / "report.json"
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        row["family"] = _family(report)
        row["family_seconds"] = {k: times.get(k) for k in ("family_s", "baseline_s", "eval_s")}
    return row


def _family(report: dict[str, Any]) -> dict[str, Any]:
    targets = report["targets"]
    group = next(v for k, v in targets.items() if k != "baseline" and "arbitrary_over_sequential" in v)
    baseline_name = next(k for k, m in report["models"].items() if m["variant"] == "baseline")
    baseline = report["models"][baseline_name]
    return {
        "arbitrary_over_sequential": round(group["arbitrary_over_sequential"], 4),
        "merged_over_arbitrary": round(group["merged_over_arbitrary"], 4),
        "ensemble_minus_best_member": round(group["ensemble_minus_best_member"], 4),
        "ensemble_minus_best_member_ci95": group.get("ensemble_minus_best_member_ci95"),
        "ensemble_vs_best_member": group.get("ensemble_vs_best_member"),
        "pruning_monotone_arbitrary": group["pruning_monotone_arbitrary"],
        "baseline_sequential": round(baseline["sequential"], 4),
        "baseline_arbitrary": round(baseline["arbitrary"]["mean"], 4),
        "chance": report["chance"],
    }


def render(summary: dict[str, Any]) -> str:
    head = "| task | train images | ViT val (seq / arb) | reference CNN | ratio | ViT training | ended by "
    head += "| test (seq / arb) |"
    lines = [head, "| --- " * 8 + "|"]
    for r in summary["rows"]:
        stopped = (
            "early stop"
            if "improved" in (r["stopped"] or "")
            else "time budget"
            if "budget" in (r["stopped"] or "")
            else r["stopped"]
        )
        lines.append(
            f"| {r['task']} | {r['train_images']:,} | {r['vit_val_sequential']:.3f} / {r['vit_val_arbitrary']:.3f} | "
            f"{r['reference_val']:.3f} ({r['reference_steps']:,} steps) | {_ratio(r['ratio_sequential'])} | "
            f"{r['training_seconds']:.0f} s, {r['epochs']} epochs | {stopped} | "
            f"{r['test_sequential']:.3f} / {r['test_arbitrary']:.3f} |"
        )
    families = [r for r in summary["rows"] if "family" in r]
    if families:
        lines += [
            "",
            "| task | arbitrary / sequential | merged / arbitrary | ensemble - best member | pruning monotone "
            "| baseline seq / arb (chance) | baseline keeps above chance |",
            "| --- " * 7 + "|",
        ]
        for r in families:
            f = r["family"]
            lines.append(
                f"| {r['task']} ({r['train_images']:,}) | {f['arbitrary_over_sequential']:.3f} | "
                f"{f['merged_over_arbitrary']:.3f} | {_margin(f)} | "
                f"{f['pruning_monotone_arbitrary']} | {f['baseline_sequential']:.3f} / {f['baseline_arbitrary']:.3f} "
                f"({f['chance']:.3f}) | {_collapse(f)} |"
            )
    return "\n".join(lines)


def _collapse(family: dict[str, Any]) -> str:
    """The share of its in-order accuracy above chance the baseline keeps in arbitrary order, and whether
    that is a collapse (training.evaluation.evaluate.COLLAPSED_AT)."""
    kept = kept_above_chance(family["baseline_sequential"], family["baseline_arbitrary"], family["chance"])
    return f"{kept:.2f}, " + ("**collapsed**" if kept <= COLLAPSED_AT else "not collapsed")


def _margin(family: dict[str, Any]) -> str:
    """The ensemble's margin in points, with its 95% interval and verdict where the report has them."""
    shown = f"{family['ensemble_minus_best_member'] * 100:+.2f} points"
    interval = family.get("ensemble_minus_best_member_ci95")
    if interval:
        lo, hi = (100 * v for v in interval)
        shown += f" [{lo:+.2f}, {hi:+.2f}], {family['ensemble_vs_best_member']}"
    return shown


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"**{value:.2f}**"  # None: the reference learned nothing to compare


def run_row(model_dir: Path) -> dict[str, Any]:
    """One training run read back from its manifest (a `--runs` comparison such as the size ladder's):
    the command, the size, the test accuracy, the kept epoch's validation and what ended training."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    recipe, config, metrics = manifest["recipe"], manifest["config"], manifest["metrics"]
    history = recipe.get("history", [])
    kept = kept_record(recipe)
    reference = metrics.get("learned", {}).get("reference")
    data_dir = Path(manifest["dataset"]["spec"].split(":", 1)[1])
    return {
        # scripts/own_data_check.sh's folders are TASK-N/data; any other data folder is named by itself.
        "task": data_dir.parent.name.rsplit("-", 1)[0] if data_dir.name == "data" else data_dir.name,
        "train_images": manifest["dataset"]["train"],
        "dim": config["dim"],
        "depth": config["depth"],
        "heads": config["heads"],
        "block_params": block_params(config["dim"], config["depth"]),
        "command": recipe.get("command"),
        "test_sequential": metrics.get("test_sequential"),
        "test_arbitrary": metrics.get("test_arbitrary"),
        "best_val_loss": round(kept["val_loss"], 4) if kept else None,
        "best_val_acc": kept.get("val_acc"),
        "best_val_acc_arbitrary": kept.get("val_acc_arbitrary"),
        "reference_val": reference["val_acc"] if reference else None,
        "reference_seconds": reference["seconds"] if reference else None,
        "ratio_sequential": round(kept["val_acc"] / reference["val_acc"], 3) if reference and kept else None,
        "epochs": len(history),
        "planned_steps": history[-1].get("planned_steps") if history else None,
        "training_s": round(sum(h.get("seconds", 0.0) for h in history), 1),
        "stopped": recipe.get("stopped"),
    }


def kept_record(recipe: dict[str, Any]) -> dict[str, Any]:
    """The history record of the epoch whose weights the run kept. A shuffle-ramp run from before the
    trainer marked it (2026-11-26) kept the lowest validation loss among the epochs after which the ramp
    was over (steps done >= share x planned steps, as Trainer.ramping decided), rebuilt here."""
    history, share = recipe.get("history", []), recipe.get("shuffle_ramp", 0.0)
    if not history:
        return {}
    if share and not any("kept" in h for h in history):
        steps_per_epoch = round(history[0]["seconds"] / history[0]["step_s"])
        past = [h for h in history if h["epoch"] * steps_per_epoch >= share * h["planned_steps"]]
        return min(past, key=lambda h: h["val_loss"]) if past else history[-1]
    return dict(kept_epoch_record(history) or {})


# Flags that say where a run reads and writes or how fast it goes, not what it trains: left out of the table.
PLUMBING = {"--data": 1, "--out": 1, "--threads": 1, "--workers": 1, "--no-reference": 0, "--overwrite": 0}


def training_flags(command: str | None) -> str:
    """What a run's command asked for beyond the defaults ("defaults" when nothing): the table's way to
    tell apart runs that differ by a flag."""
    words = shlex.split(command or "")[2:]  # after `layerswarm train`
    kept: list[str] = []
    while words:
        word = words.pop(0)
        if word in PLUMBING:
            del words[: PLUMBING[word]]
        else:
            kept.append(word)
    return " ".join(kept) or "defaults"


def render_runs(rows: list[dict[str, Any]]) -> str:
    lines = ["| task | train images | flags | D x blocks (heads) | block parameters | test seq / arb | best val loss "]
    lines[0] += "| epochs, training | ended by | kept val seq / arb | reference CNN val (s) | ratio |"
    lines.append("| --- " * 12 + "|")
    for r in sorted(rows, key=lambda r: (r["task"], r["train_images"], r["block_params"], r["command"] or "")):
        ended = "early stop" if "improved" in (r["stopped"] or "") else "time budget"
        lines.append(
            f"| {r['task']} | {r['train_images']:,} | {training_flags(r['command'])} | "
            f"{r['dim']} x {r['depth']} ({r['heads']}) | "
            f"{r['block_params']:,} | {r['test_sequential']:.3f} / {r['test_arbitrary']:.3f} | "
            f"{r['best_val_loss']:.3f} | {r['epochs']}, {r['training_s']:.0f} s | {ended} | "
            f"{r['best_val_acc']:.3f} / {r['best_val_acc_arbitrary']:.3f} | {_reference(r)} |"
        )
    return "\n".join(lines)


def _reference(row: dict[str, Any]) -> str:
    if row["reference_val"] is None:
        return "- | -"
    return f"{row['reference_val']:.3f} ({row['reference_seconds']:.0f} s) | **{row['ratio_sequential']:.2f}**"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path, nargs="?", help="the folder scripts/own_data_check.sh wrote into")
    parser.add_argument("--runs", type=Path, nargs="+", help="model directories to compare, one row each, instead")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    if args.runs:
        if missing := [str(d) for d in args.runs if not (d / "manifest.json").is_file()]:
            parser.error(f"--runs: not model directories (no manifest.json): {', '.join(missing)}")
        rows = [run_row(d) for d in args.runs]
        report = {"written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": MACHINE, "runs": rows}
        return emit_table(report, render_runs(rows), args.json, args.markdown)
    if args.work is None:
        parser.error("give the work folder, or --runs")
    summary = summarize(args.work)
    return emit_table(summary, render(summary), args.json, args.markdown)


if __name__ == "__main__":
    raise SystemExit(main())
