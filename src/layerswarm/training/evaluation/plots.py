"""Figures like the paper's: accuracy against blocks kept (Figure 1), merged accuracies (Figure 5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from .report import EvalReport, Pruned


def plot_pruning(report: EvalReport, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, order in zip(axes, ("sequential", "arbitrary"), strict=True):
        for name, m in report["models"].items():
            ks = [int(k) for k in m["pruned"]]
            ax.plot(ks, [_at(m["pruned"][str(k)], order) for k in ks], marker="o", label=f"{name} ({m['variant']})")
        _chance_line(ax, report)
        ax.set_title(f"{order} order")
        ax.set_xlabel("blocks kept")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Accuracy against blocks kept (cf. LayerShuffle, Figure 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_merged(report: EvalReport, path: Path) -> Path:
    groups = report["groups"]
    fig, ax = plt.subplots(figsize=(max(4, 3 * len(groups)), 4))
    labels, positions = [], []
    for i, (key, g) in enumerate(groups.items()):
        base = i * 4
        members = [report["models"][n]["arbitrary"]["mean"] for n in g["members"]]
        ax.bar(base, sum(members) / len(members), color="tab:blue", label="members" if i == 0 else None)
        ax.bar(
            base + 1,
            g["merged"]["mean"],
            yerr=g["merged"]["std"],
            color="tab:orange",
            label="merged" if i == 0 else None,
            capsize=4,
        )
        ax.bar(base + 2, g["ensemble"], color="tab:green", label="ensemble" if i == 0 else None)
        labels.append(f"{g['variant']}\n{key.split('/')[0][:12]}")
        positions.append(base + 1)
    _chance_line(ax, report)
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_ylabel("test accuracy, arbitrary order")
    ax.set_title("Members, merged models and ensembles (cf. LayerShuffle, Figure 5)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _at(pruned: Pruned, order: str) -> float:
    return pruned["arbitrary"] if order == "arbitrary" else pruned["sequential"]


def _chance_line(ax: Any, report: EvalReport) -> None:
    """Accuracy of guessing (1 / classes): a model near it has learned nothing."""
    chance = report.get("chance") or 1.0 / len(report["dataset"]["classes"])
    ax.axhline(chance, color="grey", linestyle="--", linewidth=1, label=f"chance ({chance:.2f})")


def plot_exits(report: EvalReport, path: Path) -> Path:
    """Accuracy against mean blocks run, one curve per exit rule and model (cf. the early-exit papers),
    with static pruning in arbitrary order for reference where the report has it."""
    calibration = report["calibration"]
    fig, axes = plt.subplots(1, len(calibration), figsize=(5 * len(calibration), 4), sharey=True, squeeze=False)
    for ax, (name, c) in zip(axes[0], calibration.items(), strict=True):
        exits = c["exits"]
        for rule, r in exits["rules"].items():
            curve = r["curve"]
            ax.plot([p["mean_blocks"] for p in curve], [p["accuracy"] for p in curve], marker=".", label=rule)
            if r["chosen"]:
                held = r["chosen"]["held_out"]
                ax.scatter([held["mean_blocks"]], [held["accuracy"]], s=80, marker="*", zorder=5)
        row = report.get("models", {}).get(name)
        pruned = row["pruned"] if row else None
        if pruned:
            ks = sorted(int(k) for k in pruned)
            ax.plot(ks, [pruned[str(k)]["arbitrary"] for k in ks], "k--", alpha=0.5, label="static pruning")
        full = exits["full_accuracy"]["held_out"]
        ax.axhline(full - exits["margin"], color="grey", lw=0.8, ls=":", label=f"full path - {exits['margin']:.2f}")
        ax.set_title(f"{name} ({c['order']} order)")
        ax.set_xlabel("mean blocks run per image")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("held-out accuracy")
    fig.suptitle("Early exit: accuracy against compute (stars: calibrated thresholds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
