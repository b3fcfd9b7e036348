"""bench/seed_screen.py: real `layerswarm train` processes per recipe and seed, counted per recipe."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from layerswarm.bench.seed_screen import main, outcome, parse_recipe, parse_seeds
from layerswarm.training.data.synthetic import write

TINY = "--depth 2 --dim 16 --heads 2"


def test_seed_lists_and_recipes_parse_or_say_why() -> None:
    assert parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert parse_recipe('in-order=--variant baseline --lr "2e-3"') == (
        "in-order",
        ["--variant", "baseline", "--lr", "2e-3"],
    )
    assert parse_recipe("default=") == ("default", [])
    for bad in ("x", "0-", "a-b", "-1"):
        with pytest.raises(ValueError, match="not a seed list"):
            parse_seeds(bad)
    for bad in ("--lr 2e-3", "a b=--lr 1", "../x=--lr 1"):
        with pytest.raises(ValueError, match="not a recipe"):
            parse_recipe(bad)


def test_a_bad_recipe_is_a_usage_error_naming_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["shapes", "--epochs", "1", "--recipe", "no-equals-sign", "--work", str(tmp_path)])
    assert stop.value.code == 2
    assert "--recipe" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["shapes", "--epochs", "1", "--recipe", "a=", "--work", str(tmp_path / "none"), "--collect"])
    assert "no such folder" in capsys.readouterr().err


def test_each_recipe_runs_over_the_seeds_and_is_counted(tmp_path: Path) -> None:
    write("compare", tmp_path / "data", train=64, val=32)
    work, report_path = tmp_path / "work", tmp_path / "screen.json"
    recipes = ["--recipe", f"default={TINY}", "--recipe", f"in-order=--variant baseline {TINY}"]
    argv = [f"imagefolder:{tmp_path / 'data'}", "--epochs", "1", "--seeds", "0-1", *recipes, "--parallel", "2"]
    assert main([*argv, "--work", str(work), "--name", "t", "--threshold", "0", "--json", str(report_path)]) == 0

    report = json.loads(report_path.read_text())
    assert [(r["recipe"], r["runs"], r["past_threshold"]) for r in report["recipes"]] == [
        ("default", 2, 2),
        ("in-order", 2, 2),
    ]
    # The recipe's flags reached the trainer, with each run's own seed.
    for recipe, variant in (("default", "layershuffle"), ("in-order", "baseline")):
        for seed in (0, 1):
            trained = json.loads((work / f"t-{recipe}-s{seed}" / "manifest.json").read_text())["recipe"]
            assert (trained["variant"], trained["seed"], trained["epochs"]) == (variant, seed, 1)
    # --collect reads the same runs back from their logs without starting any.
    assert (
        main([*argv, "--work", str(work), "--name", "t", "--threshold", "0", "--collect", "--json", str(report_path)])
        == 0
    )
    assert json.loads(report_path.read_text())["runs"] == report["runs"]


def test_a_run_that_fails_is_reported_not_counted(tmp_path: Path) -> None:
    write("compare", tmp_path / "data", train=16, val=8)
    recipes = ["--recipe", "typo=--no-such-flag", "--recipe", "bad-lr=--lr -1"]
    argv = [f"imagefolder:{tmp_path / 'data'}", "--epochs", "1", "--seeds", "0", *recipes, "--work", str(tmp_path)]
    assert main([*argv, "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert [(r["runs"], r["unfinished"]) for r in report["recipes"]] == [(0, 1), (0, 1)]
    assert "1 unfinished: see the logs" in (tmp_path / "r.md").read_text()
    assert "--no-such-flag" in (tmp_path / "screen-typo-s0.log").read_text()


def test_a_run_that_never_finished_is_not_counted(tmp_path: Path) -> None:
    log = tmp_path / "t-default-s0.log"
    log.write_text("epoch 1/36: train loss 2.08\nepoch 2/36: train loss 2.07\n")
    assert outcome(log) == {"epochs": 2, "finished": False}
    log.write_text(log.read_text() + '{"event": "trained", "test_sequential": 0.5, "test_arbitrary": 0.25}\n')
    assert outcome(log) == {"epochs": 2, "finished": True, "test_sequential": 0.5, "test_arbitrary": 0.25}


def test_a_screen_stopped_early_ends_the_runs_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from layerswarm.bench import seed_screen

    sleeper = (sys.executable, "-c", "import time; time.sleep(60)")
    runs = [seed_screen.Run("r", seed, tmp_path / f"r-s{seed}.log", sleeper) for seed in range(3)]
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(seed_screen.subprocess, "Popen", popen)
    monkeypatch.setattr(seed_screen.time, "sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        seed_screen.launch(runs, parallel=2)
    assert len(started) == 2 and all(proc.poll() is not None for proc in started)  # ended and reaped


TERMINATED_SCREEN = """
import subprocess, sys, time
from pathlib import Path
from layerswarm.bench import seed_screen

pids, real_popen = Path(sys.argv[1]), subprocess.Popen

def popen(*args, **kwargs):
    proc = real_popen(*args, **kwargs)
    with pids.open("a") as out:
        out.write(f"{proc.pid}\\n")
    return proc

seed_screen.subprocess.Popen = popen
sleeper = (sys.executable, "-c", "import time; time.sleep(60)")
runs = [seed_screen.Run("r", seed, pids.parent / f"r-s{seed}.log", sleeper) for seed in range(3)]
seed_screen.launch(runs, parallel=2)
"""


def test_a_screen_sent_sigterm_ends_the_runs_it_started(tmp_path: Path) -> None:
    """`kill PID` (or a job runner's timeout) on a screen must not leave its runs training unowned."""
    pids = tmp_path / "pids"
    screen = subprocess.Popen([sys.executable, "-c", TERMINATED_SCREEN, str(pids)], stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        for _ in range(200):  # both runs started: at most 20 s
            children = [int(line) for line in pids.read_text().split()] if pids.is_file() else []
            if len(children) == 2:
                break
            time.sleep(0.1)
        assert len(children) == 2
        screen.send_signal(signal.SIGTERM)
        assert screen.wait(timeout=30) == 128 + signal.SIGTERM
        for pid in children:  # ended and reaped by the screen, so the pid is gone
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        screen.kill()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
