"""Where a command that measures models (eval, depth) writes what it measured.

A model directory is written only when it is the user's own: never the shipped zoo (the installed
package's files), never a directory the user cannot write. `--policy-out DIR` writes evaluated copies
instead: each model directory copied whole to DIR/NAME (weights, manifest, policy files), so the copy
is a complete model a coordinator can serve and the original stays as it was.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from layerswarm.models.checkpoint import read_any_manifest
from layerswarm.models.zoo import is_shipped

from .base import UsageError


def write_refusal(model_dir: Path) -> str | None:
    """Why a command must not write into `model_dir`, or None when it may."""
    if is_shipped(model_dir):
        return f"{model_dir} is a shipped model (part of the installed package)"
    if not os.access(model_dir, os.W_OK):
        return f"{model_dir} is not writable"
    return None


def policy_targets(model_dirs: list[Path], policy_out: Path | None, *, no_write_flag: str) -> list[Path]:
    """The directories a measuring command evaluates and writes into: `model_dirs` themselves, or their
    copies under `policy_out`. Raises UsageError (before any work) where writing is not allowed."""
    for model_dir in model_dirs:
        read_any_manifest(model_dir)  # a clear error for a directory that is not a model, before any copy
    if policy_out is None:
        for model_dir in model_dirs:
            problem = write_refusal(model_dir)
            if problem:
                raise UsageError(
                    f"{problem}: pass --policy-out DIR to write evaluated copies there, or {no_write_flag} "
                    "to measure without writing"
                )
        return model_dirs
    copies = []
    for model_dir in model_dirs:
        dst = policy_out / model_dir.resolve().name
        if dst.exists():
            raise UsageError(f"--policy-out: {dst} already exists (choose an empty folder)")
        copies.append(dst)
    if len({c.name for c in copies}) != len(copies):
        raise UsageError("--policy-out: two model directories share a name; evaluate them in separate runs")
    policy_out.mkdir(parents=True, exist_ok=True)
    for model_dir, dst in zip(model_dirs, copies, strict=True):
        shutil.copytree(model_dir, dst, ignore=shutil.ignore_patterns("*.tmp", ".train_state*"))
    return copies
