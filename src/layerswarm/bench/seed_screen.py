"""How often a recipe gets past a plateau: `layerswarm train` over many seeds and a few recipes, side by
side, each run's test accuracy and, per recipe, how many runs got past a threshold.

A plateau like `compare`'s (docs/own-data.md, "A task the default command does not always learn") is left in a
sudden jump or not at all, so one run per recipe says little about a recipe; counts over seeds do.
Runs are step-matched: each trains a fixed number of epochs with the time budget out of the way, so a
GPU run takes the steps a CPU run takes in its budget (`compare` at 20,000 images on one core of the
2-core machine: 36 epochs of 141 steps in 600 s; read the epochs off that run's table). What carries
over between devices is the rate, not any one seed's trajectory.

    python -m layerswarm.bench.seed_screen imagefolder:DATA --epochs 36 --seeds 0-10 \\
        --recipe default= --recipe in-order="--variant baseline" --device cuda --parallel 16 \\
        --work WORK --name c20k --json OUT.json --markdown OUT.md

Each run's log is WORK/NAME-RECIPE-sSEED.log and its model WORK/NAME-RECIPE-sSEED/. With --collect it
starts nothing and summarises the logs an earlier run left in WORK (every seed found, per recipe).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from . import emit_table

# Fixed for every run: no reference CNN (not what is screened), one thread each (runs share the cores),
# no loader workers, and a time budget no run reaches, so --epochs alone sets the step schedule.
COMMON = ("--no-reference", "--threads", "1", "--workers", "0", "--time-budget", "1000000")


@dataclass(frozen=True)
class Run:
    recipe: str
    seed: int
    log: Path
    argv: tuple[str, ...]


def parse_seeds(text: str) -> list[int]:
    """'0-10' or '0,2,5' (or both: '0-3,7') as a sorted list of seeds."""
    seeds: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"not a seed list: {text!r} (e.g. 0-10 or 0,2,5)")
        seeds.update(range(int(low), int(high or low) + 1))
    return sorted(seeds)


def parse_recipe(text: str) -> tuple[str, list[str]]:
    """'NAME=FLAGS' (FLAGS as a shell would split them; empty: the default command)."""
    name, sep, flags = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*", name):
        raise ValueError(f"not a recipe: {text!r} (NAME=FLAGS, NAME in letters, digits, '-', '_', '.')")
    return name, shlex.split(flags)


def plan(args: argparse.Namespace, recipes: dict[str, list[str]], seeds: list[int]) -> list[Run]:
    runs = []
    for recipe, flags in recipes.items():
        for seed in seeds:
            stem = args.work / f"{args.name}-{recipe}-s{seed}"
            argv = (
                *(sys.executable, "-m", "layerswarm", "train", "--data", args.data, "--out", str(stem)),
                *("--epochs", str(args.epochs), "--seed", str(seed), "--device", args.device, *COMMON, *flags),
            )
            runs.append(Run(recipe, seed, stem.with_suffix(".log"), argv))
    return runs


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through launch's `finally`, which ends the runs


def launch(runs: list[Run], parallel: int) -> None:
    """Every run, at most `parallel` at a time, each writing its log; returns when all have ended. Stopped
    early (Ctrl-C, or SIGTERM from a job runner or `kill`), it ends the runs it started rather than leaving
    them training on their own."""
    pending = list(runs)
    active: list[subprocess.Popen[bytes]] = []
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        with tqdm(total=len(runs), desc="runs", unit="run") as bar:
            while pending or active:
                while pending and len(active) < parallel:
                    run = pending.pop(0)
                    run.log.parent.mkdir(parents=True, exist_ok=True)
                    with run.log.open("w") as log:
                        active.append(subprocess.Popen(run.argv, stdout=log, stderr=subprocess.STDOUT))
                time.sleep(1.0)
                running = [proc for proc in active if proc.poll() is None]
                if ended := len(active) - len(running):  # no redraw otherwise: a log file gets a line per run
                    bar.update(ended)
                active = running
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in active:
            proc.terminate()
        for proc in active:
            proc.wait()


def found_runs(work: Path, name: str, recipes: dict[str, list[str]]) -> list[Run]:
    """The runs an earlier screen left in `work`, from their log names."""
    runs = []
    for recipe in recipes:
        for log in work.glob(f"{name}-{recipe}-s*.log"):
            if (seed := log.stem.rpartition("-s")[2]).isdigit():
                runs.append(Run(recipe, int(seed), log, ()))
    return sorted(runs, key=lambda r: (list(recipes).index(r.recipe), r.seed))


def outcome(log: Path) -> dict[str, Any]:
    """A run's test accuracies (from its "trained" event) and the last epoch it logged."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    trained = [json.loads(line) for line in text.splitlines() if line.startswith('{"event": "trained"')]
    epochs = re.findall(r"^epoch (\d+)/\d+:", text, flags=re.MULTILINE)
    result: dict[str, Any] = {"epochs": int(epochs[-1]) if epochs else 0, "finished": bool(trained)}
    if trained:
        result |= {k: trained[-1].get(k) for k in ("test_sequential", "test_arbitrary")}
    return result


def summarize(args: argparse.Namespace, recipes: dict[str, list[str]], runs: list[Run]) -> dict[str, Any]:
    rows = [{"recipe": r.recipe, "seed": r.seed, **outcome(r.log)} for r in runs]
    per_recipe = []
    for recipe, flags in recipes.items():
        done = [row for row in rows if row["recipe"] == recipe and row["finished"]]
        accs = [row["test_sequential"] for row in done]
        arb = [row["test_arbitrary"] for row in done]
        per_recipe.append(
            {
                "recipe": recipe,
                "flags": shlex.join(flags),
                "runs": len(done),
                "unfinished": sum(row["recipe"] == recipe and not row["finished"] for row in rows),
                "past_threshold": sum(acc >= args.threshold for acc in accs),
                "median_test_sequential": round(statistics.median(accs), 3) if accs else None,
                "median_test_arbitrary": round(statistics.median(arb), 3) if arb else None,
                "test_sequential_sorted": sorted(accs),
                "seeds_past": [row["seed"] for row in done if row["test_sequential"] >= args.threshold],
            }
        )
    return {
        "data": args.data,
        "machine": args.machine or f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "device": args.device,
        "epochs": args.epochs,
        "threshold": args.threshold,
        "command": "layerswarm train --data DATA --out RUN --epochs E --seed S --device D " + shlex.join(COMMON),
        "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "recipes": per_recipe,
        "runs": rows,
    }


def unfinished(recipe: dict[str, Any]) -> str:
    """A note of the runs that ended without a model (see their logs), for the table."""
    return f" ({recipe['unfinished']} unfinished: see the logs)" if recipe["unfinished"] else ""


def render(report: dict[str, Any]) -> str:
    lines = [
        f"| recipe (flags) | runs | test >= {report['threshold']} (seeds) | test in order, each run "
        "| median test, in order / arbitrary order |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in report["recipes"]:
        seeds = ", ".join(map(str, r["seeds_past"])) or "none"
        lines.append(
            f"| {r['recipe']} (`{r['flags'] or 'default'}`) | {r['runs']}{unfinished(r)} "
            f"| {r['past_threshold']} ({seeds}) "
            f"| {', '.join(f'{acc:.2f}' for acc in r['test_sequential_sorted'])} "
            f"| {r['median_test_sequential']} / {r['median_test_arbitrary']} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m layerswarm.bench.seed_screen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("data", help="layerswarm train's --data, e.g. imagefolder:PATH")
    parser.add_argument("--epochs", type=int, required=True, help="epochs per run (the step-matched schedule)")
    parser.add_argument("--seeds", default="0-3", help="training seeds: 0-10 or 0,2,5 (default: 0-3)")
    parser.add_argument(
        "--recipe", action="append", required=True, help="NAME=FLAGS added to the default command (repeatable)"
    )
    parser.add_argument("--device", default="cpu", help="layerswarm train's --device for every run (default: cpu)")
    parser.add_argument(
        "--parallel", type=int, default=2, help="runs at a time (default: 2; one core or a share of the GPU each)"
    )
    parser.add_argument("--work", type=Path, required=True, help="folder for the runs' logs and models")
    parser.add_argument("--name", default="screen", help="prefix of every run's name (default: screen)")
    parser.add_argument(
        "--threshold", type=float, default=0.9, help="test accuracy that counts as past the plateau (default: 0.9)"
    )
    parser.add_argument("--collect", action="store_true", help="start nothing: summarise the logs in --work")
    parser.add_argument("--machine", default="", help="the machine the runs ran on (default: this one)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        recipes = dict(parse_recipe(text) for text in args.recipe)
        seeds = parse_seeds(args.seeds)
    except ValueError as error:
        parser.error(f"--recipe/--seeds: {error}")
    if args.epochs < 1 or args.parallel < 1:
        parser.error("--epochs and --parallel must be at least 1")
    if args.collect:
        if not args.work.is_dir():
            parser.error(f"--work {args.work}: no such folder to collect from")
        runs = found_runs(args.work, args.name, recipes)
    else:
        runs = plan(args, recipes, seeds)
        launch(runs, args.parallel)
    report = summarize(args, recipes, runs)
    return emit_table(report, render(report), args.json, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
