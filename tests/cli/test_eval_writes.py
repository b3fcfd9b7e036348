"""`layerswarm eval` never breaks a model: a rewritten manifest keeps its policy files, and the shipped
zoo (the installed package's own files) is never written; --policy-out writes evaluated copies."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layerswarm.coordinator.routing.exits import load_defaults
from layerswarm.models.adaptive_policy import read_policy
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.policy import MIN_BLOCKS, write_entry
from layerswarm.models.zoo import family_root

MEMBER = family_root() / "layershuffle-0"  # ships an adaptive.json listed in its manifest's policy_files


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def test_a_policy_entry_keeps_the_policy_files_the_coordinator_checks(tmp_path: Path) -> None:
    copy = tmp_path / MEMBER.name
    shutil.copytree(MEMBER, copy)
    assert read_policy(copy) is not None
    write_entry(copy, MIN_BLOCKS, {"value": 4, "margin": 0.01, "order": "arbitrary"})
    assert read_manifest(copy).policy_files  # lost before: the coordinator then refused the directory
    assert read_policy(copy) is not None
    load_defaults(copy, "calibrated", None)  # what `layerswarm coordinator --model-dir` does at start


def run_eval(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "layerswarm", "eval", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)


def test_eval_refuses_to_write_into_the_shipped_zoo() -> None:
    before = tree_digest(MEMBER)
    done = run_eval(str(MEMBER), "--orders", "10", "--merges", "20")
    assert done.returncode == 2
    assert "is a shipped model" in done.stderr and "--policy-out" in done.stderr
    assert "Traceback" not in done.stderr
    assert tree_digest(MEMBER) == before


@pytest.mark.slow
def test_eval_with_policy_out_writes_a_servable_copy_and_leaves_the_original(tmp_path: Path) -> None:
    before = tree_digest(MEMBER)
    done = run_eval(str(MEMBER), "--orders", "10", "--merges", "20", "--policy-out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    copy = tmp_path / "out" / MEMBER.name
    assert read_manifest(copy).policy.get(MIN_BLOCKS)
    assert read_policy(copy) is not None
    load_defaults(copy, "calibrated", None)
    assert tree_digest(MEMBER) == before
    again = run_eval(
        str(MEMBER), "--no-policy", "--orders", "10", "--merges", "20", "--policy-out", str(tmp_path / "out")
    )
    assert again.returncode == 0, again.stderr  # nothing written: --policy-out is not even looked at
