"""`layerswarm samples DIR`: labelled sample inputs of a model's task, as PNGs to send to a swarm."""

from __future__ import annotations

import argparse
from pathlib import Path

from .base import Subparsers, UsageError, add_command, folder, positive_int


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "samples",
        run,
        help="write labelled sample images of a family's task (PNG) to send to a swarm",
        description="Write test images of the data a model was trained on as DIR/NNN-LABEL.png, the label "
        "being the class the image shows: inputs for curl, the HTTP API and the clients.",
    )
    p.add_argument("dir", type=folder, help="folder to write into (created if missing)")
    p.add_argument(
        "--family",
        default="zoo:shapes",
        help="whose task the samples show: a shipped family by name (shapes) or zoo:FAMILY[/MEMBER], or a folder "
        "(a family folder or a model directory)",
    )
    p.add_argument("--count", type=positive_int, default=10, help="how many images")


def run(args: argparse.Namespace) -> int:
    from layerswarm.harness.samples import task_data, write_samples
    from layerswarm.models.checkpoint import read_manifest

    model_dir = model_of(args.family)
    if read_manifest(model_dir).config.is_text:
        raise UsageError(
            f"--family {args.family}: a text model; samples are images (send sentences to /v1/classify/text)"
        )
    written = write_samples(task_data(model_dir), args.dir, args.count)
    for path in written:
        print(path)
    return 0


def model_of(family: str) -> Path:
    """--family's model directory (a family folder: its first member; they share one task)."""
    from layerswarm.models.zoo import model_dirs, resolve_family

    try:
        model_dir = resolve_family(family)
    except ValueError as exc:  # it names the zoo: spec and lists the shipped ones
        raise UsageError(f"--family {exc}") from None
    if (model_dir / "manifest.json").is_file():
        return model_dir
    if not model_dir.is_dir():
        raise UsageError(f"--family {family}: no such folder (a family folder, a model directory or zoo:FAMILY)")
    try:
        return model_dirs(model_dir)[0][0]
    except (OSError, ValueError) as exc:  # no model directories in it; a broken manifest
        raise UsageError(f"--family {family}: {exc}") from None
