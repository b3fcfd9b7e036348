"""What `layerswarm train`, `family` and `eval` do (their flags live in layerswarm/cli/)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

from .checkpoint import ModelDirError, read_manifest, save_model
from .data import load_dataset
from .evaluate import EvalPlan, check_targets, evaluate_models
from .train import Trainer, TrainRecipe, build_model

log = logging.getLogger(__name__)


def train_main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    data = load_dataset(args.data, seed=args.data_seed)
    arch = {"depth": args.depth, "dim": args.dim, "heads": args.heads, "patch_size": args.patch_size}
    model, lineage = build_model(data, args.variant, args.init, arch, args.seed)
    recipe = TrainRecipe(
        variant=args.variant,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        augment=not args.no_augment,
        threads=args.threads,
    )
    trainer = Trainer(model, data, recipe, device, args.out / ".train_state")
    if args.resume:
        trainer.load_state()
    trainer.fit()
    model = trainer.model.cpu().eval()
    metrics = _quick_metrics(model, data)
    recipe_record = {
        **asdict(recipe),
        "init": args.init,
        "command": args.command_line,
        "history": trainer.history,
        "seconds": round(time.perf_counter() - started, 1),
    }
    dataset = {**data.describe(), "data_seed": args.data_seed}
    manifest = save_model(model, args.out, lineage, recipe=recipe_record, dataset=dataset, metrics=metrics)
    print(
        json.dumps(
            {
                "event": "trained",
                "out": str(args.out),
                "model_id": manifest.model_id,
                "family_id": manifest.family_id,
                "variant": args.variant,
                **metrics,
            }
        )
    )
    return 0


@torch.inference_mode()
def _quick_metrics(model: Any, data: Any, orders: int = 5) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    x, y = data.test_x, data.test_y
    seq = float((model(x).argmax(-1) == y).float().mean())
    depth = len(model.blocks)
    arb = [
        float((model(x, torch.randperm(depth, generator=gen).tolist()).argmax(-1) == y).float().mean())
        for _ in range(orders)
    ]
    return {"test_sequential": round(seq, 4), "test_arbitrary": round(sum(arb) / len(arb), 4)}


def family_main(args: argparse.Namespace) -> int:
    base = read_manifest(args.base)
    data = args.data or base.dataset.get("spec")
    if not data:
        raise SystemExit("layerswarm family: --data is needed (the base manifest names no dataset)")
    data_seed = str(base.dataset.get("data_seed", 0))
    cmds = []
    for i in range(args.members):
        out = args.out / f"{args.prefix}-{i}"
        cmds.append(
            [
                sys.executable,
                "-m",
                "layerswarm",
                "train",
                "--data",
                data,
                "--data-seed",
                data_seed,
                "--variant",
                args.variant,
                "--init",
                str(args.base),
                "--out",
                str(out),
                "--epochs",
                str(args.epochs),
                "--lr",
                str(args.lr),
                "--seed",
                str(args.first_seed + i),
                "--threads",
                "1",
            ]
        )
    failed = _run_parallel(cmds, args.jobs)
    if failed:
        print(f"layerswarm family: {failed} member(s) failed", file=sys.stderr)
        return 1
    for i in range(args.members):
        m = read_manifest(args.out / f"{args.prefix}-{i}")
        print(
            f"{args.prefix}-{i}: {m.model_id} family {m.family_id} seq {m.metrics.get('test_sequential')} "
            f"arb {m.metrics.get('test_arbitrary')}"
        )
    return 0


def _run_parallel(cmds: list[list[str]], jobs: int) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pending, failed = list(cmds), 0
    running: list[subprocess.Popen[bytes]] = []
    while pending or running:
        while pending and len(running) < max(1, jobs):
            running.append(subprocess.Popen(pending.pop(0), env=env))
        time.sleep(0.5)
        for proc in [p for p in running if p.poll() is not None]:
            running.remove(proc)
            failed += proc.returncode != 0
    return failed


def eval_main(args: argparse.Namespace) -> int:
    try:
        first = read_manifest(args.model_dirs[0])
    except ModelDirError as exc:
        raise SystemExit(f"layerswarm eval: {exc}") from exc
    spec = args.data or first.dataset.get("spec")
    if not spec:
        raise SystemExit("layerswarm eval: --data is needed (the manifest names no dataset)")
    data = load_dataset(spec, seed=int(first.dataset.get("data_seed", 0)))
    report = evaluate_models(
        [str(d) for d in args.model_dirs], data, EvalPlan(orders=args.orders, merges=args.merges, seed=args.seed)
    )
    report["targets"] = check_targets(report, chance=1.0 / len(data.class_names))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plots:
        from .plots import plot_merged, plot_pruning

        args.plots.mkdir(parents=True, exist_ok=True)
        plot_pruning(report, args.plots / "accuracy_vs_blocks.png")
        if report["groups"]:
            plot_merged(report, args.plots / "merged.png")
    print(render_table(report))
    return 0


def render_table(report: dict[str, Any]) -> str:
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
        lines.append(
            f"| ensemble of {n} members (mean logits) | {g['variant']} | {g['ensemble_sequential']:.4f} | "
            f"{g['ensemble']:.4f} |"
        )
    lines += ["", _render_pruning(report)]
    if report.get("targets"):
        lines += ["", _render_targets(report["targets"])]
    return "\n".join(lines)


def _render_pruning(report: dict[str, Any]) -> str:
    rows = {name: m["pruned"] for name, m in report["models"].items()}
    ks = sorted({int(k) for pruned in rows.values() for k in pruned})
    head = "| blocks kept: sequential / arbitrary | " + " | ".join(str(k) for k in ks) + " |"
    lines = [head, "| --- |" + " --- |" * len(ks)]
    for name, pruned in rows.items():
        cells = [f"{pruned[str(k)]['sequential']:.2f} / {pruned[str(k)]['arbitrary']:.2f}" for k in ks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _render_targets(targets: dict[str, Any]) -> str:
    lines = ["| check | value |", "| --- | --- |"]
    for key, checks in targets.items():
        for name, value in checks.items():
            shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            lines.append(f"| {key.split('/')[-1]}: {name} | {shown} |")
    return "\n".join(lines)
