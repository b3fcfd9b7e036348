"""`layerswarm samples DIR`: labelled sample inputs of a model's task, as PNGs to send to a swarm."""

from __future__ import annotations

import argparse
from pathlib import Path

from .base import Subparsers, add_command, positive_int


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
        help="a family folder, a model directory or zoo:FAMILY[/MEMBER] whose task the samples show",
    )
    p.add_argument("--count", type=positive_int, default=10, help="how many images")


def folder(text: str) -> Path:
    """argparse type: a folder, or a path where one can be made (not a file)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return path


def run(args: argparse.Namespace) -> int:
    from layerswarm.harness.samples import task_data, write_samples
    from layerswarm.models.zoo import model_dirs, resolve

    from .base import UsageError

    try:
        model_dir = resolve(args.family)
    except ValueError as exc:
        raise UsageError(f"--family {exc}") from None
    if not (model_dir / "manifest.json").is_file():  # a family folder: its members share one task
        model_dir = model_dirs(model_dir)[0][0]
    written = write_samples(task_data(model_dir), args.dir, args.count)
    for path in written:
        print(path)
    return 0
