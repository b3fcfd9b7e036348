"""A mergeable family from one base: K members fine-tuned from it with different seeds, each a
`layerswarm train` process of its own (what `layerswarm family` does once cli/family.py has read its flags).

Members inherit the base's data, data seed, validation split and augmentation, so they differ only in
what their seeds (and, with bootstrap, their resamples) make of the same data.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerswarm.models.checkpoint import Manifest, read_manifest

from .runs import check_out_writable


@dataclass(frozen=True)
class FamilyJob:
    base: Path  # the model directory every member is fine-tuned from
    out: Path  # members go to OUT/<prefix>-<i>
    members: int = 4
    prefix: str = "member"
    variant: str = "layershuffle"
    epochs: int = 10
    lr: float = 1e-3
    first_seed: int = 1  # member i trains with seed first_seed + i
    bootstrap: bool = False  # each member on its own bootstrap resample of the base's training split
    jobs: int = 2  # members trained at once, one thread each
    data: str | None = None  # None: the base's data spec
    batch_size: int = 128
    device: str = "auto"
    threads: int = 1
    workers: int = 0
    overwrite: bool = False

    def member_dir(self, i: int) -> Path:
        return self.out / f"{self.prefix}-{i}"


@dataclass(frozen=True)
class FamilyResult:
    failed: int  # members whose training process failed
    members: list[tuple[Path, Manifest]]  # the trained ones (all of them when none failed)


def train_family(job: FamilyJob) -> FamilyResult:
    """Train every member (`job.jobs` at a time); refuse before any starts when a member's folder cannot
    be written or holds a model (without overwrite)."""
    failed = run_parallel(member_commands(job), job.jobs)
    if failed:
        return FamilyResult(failed, [])
    return FamilyResult(0, [(job.member_dir(i), read_manifest(job.member_dir(i))) for i in range(job.members)])


def member_commands(job: FamilyJob) -> list[list[str]]:
    """The `layerswarm train` command line of each member, after checking every member's folder."""
    base = read_manifest(job.base)
    data = job.data or base.dataset.get("spec")
    if not data:
        raise ValueError("--data is needed (the base manifest names no dataset)")
    data_seed = str(base.dataset.get("data_seed", 0))
    # The base's validation split, whatever each member's training seed: a member validating on a split
    # of its own would validate on images its base trained on.
    split_seed = base.recipe.get("split_seed")
    split_seed = str(base.recipe.get("seed", 0) if split_seed is None else split_seed)
    outs = [job.member_dir(i) for i in range(job.members)]
    for out in outs:  # before any member trains: not a refusal from member 3 after members 0-2 ran
        check_out_writable(out, overwrite=job.overwrite)
    cmds = []
    for i, out in enumerate(outs):
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
                job.variant,
                "--init",
                str(job.base),
                "--out",
                str(out),
                "--epochs",
                str(job.epochs),
                "--lr",
                str(job.lr),
                "--seed",
                str(job.first_seed + i),
                "--split-seed",
                split_seed,
                "--batch-size",
                str(job.batch_size),
                "--device",
                job.device,
                "--threads",
                str(job.threads),
                "--workers",
                str(job.workers),
                # The base's manifest holds the comparison with the reference CNN; a member's own would
                # train one for as long as the base and the member together (a member is both).
                "--no-reference",
                *(["--overwrite"] if job.overwrite else []),
                *(["--bootstrap"] if job.bootstrap else []),
                *inherited_augmentation(base.recipe),
            ]
        )
    return cmds


def inherited_augmentation(recipe: dict[str, Any]) -> list[str]:
    """The base's augmentation and regularisation choices as `train` flags: members learn under the
    base's rules (a base trained without flips must not get member fine-tunes that flip). Manifests
    written before `hflip` was recorded flipped whenever they augmented."""
    drop_path, mixup = float(recipe.get("drop_path", 0.0)), float(recipe.get("mixup", 0.0))
    regularise = (["--drop-path", str(drop_path)] if drop_path else []) + (["--mixup", str(mixup)] if mixup else [])
    augment = bool(recipe.get("augment", True))
    if not augment:
        return ["--no-augment", *regularise]
    return (["--hflip"] if recipe.get("hflip", augment) else []) + regularise


def run_parallel(cmds: list[list[str]], jobs: int) -> int:
    """Run the commands, `jobs` at a time, one OpenMP thread each; how many failed."""
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
