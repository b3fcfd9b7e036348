"""`layerswarm family`: K members fine-tuned from one base by parallel `train` processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from layerswarm.models.checkpoint import read_manifest
from layerswarm.training.family import run_parallel

# Each job notes that it started, waits (up to 20 s) until at least two jobs have started, records how many
# run at that moment, and ends. A serial runner leaves the first job waiting alone: it records 1.
JOB = """
import sys, time
from pathlib import Path
d, i, fail = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
(d / f"{i}.start").touch()
deadline = time.monotonic() + 20
while len(list(d.glob("*.start"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
running = len(list(d.glob("*.start"))) - len(list(d.glob("*.end")))
(d / f"{i}.running").write_text(str(running))
time.sleep(0.3)
(d / f"{i}.end").touch()
sys.exit(3 if fail else 0)
"""


def test_parallel_runner_runs_jobs_at_once_but_never_more_than_asked(tmp_path: Path) -> None:
    cmds = [[sys.executable, "-c", JOB, str(tmp_path), str(i), "1" if i == 2 else "0"] for i in range(5)]
    failed = run_parallel(cmds, jobs=2)
    assert failed == 1  # job 2 exited 3
    running = [int((tmp_path / f"{i}.running").read_text()) for i in range(5)]
    assert running[0] == 2  # the first job found a partner running beside it
    assert max(running) <= 2, running  # never more than --jobs at once


@pytest.mark.slow
def test_family_fine_tunes_members_of_one_family(tmp_path: Path) -> None:
    base = tmp_path / "base"
    tiny = ["--depth", "2", "--dim", "16", "--heads", "2", "--patch-size", "8", "--threads", "1"]
    train = [sys.executable, "-m", "layerswarm", "train", "--data", "shapes1:64:32", "--epochs", "1", *tiny]
    subprocess.run([*train, "--out", str(base)], check=True, capture_output=True, timeout=300)
    family = [sys.executable, "-m", "layerswarm", "family", "--base", str(base), "--out", str(tmp_path / "fam")]
    result = subprocess.run(
        [*family, "--members", "2", "--epochs", "1", "--jobs", "2", "--first-seed", "5", "--bootstrap"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    parent = read_manifest(base)
    members = [read_manifest(tmp_path / "fam" / f"member-{i}") for i in range(2)]
    assert {m.family_id for m in members} == {parent.family_id}  # mergeable with the base and each other
    assert len({m.model_id for m in members} | {parent.model_id}) == 3  # each member is its own model
    assert [m.recipe["seed"] for m in members] == [5, 6]
    # ... on the base's validation split (seed 0): before, each member's split came from its own seed, so
    # it validated (stopped early, kept an epoch, reported) on images the base had trained on.
    assert [m.recipe["split_seed"] for m in members] == [0, 0]
    assert [m.recipe["bootstrap"] for m in members] == [True, True]  # each its own resample (its seed's)
    assert parent.recipe["bootstrap"] is False
    assert all(m.dataset["spec"] == "shapes1:64:32" for m in members)  # the base's data, by default
    summary = [line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("member-")]
    assert summary == ["member-0", "member-1"]  # one summary line per member, after the members' own output
