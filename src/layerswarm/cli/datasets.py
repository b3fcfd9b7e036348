"""`layerswarm datasets TASK DIR`: write a generated image-folder dataset to try the trainer on."""

from __future__ import annotations

import argparse

from .base import Subparsers, add_command, folder, non_negative_int, positive_int

TASKS = (
    "relations",
    "textures",
    "faint-textures",
    "counting",
    "compare",
)  # training.data.synthetic.TASKS; kept torch- and numpy-free here


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "datasets",
        run,
        help="write a generated 8-class image-folder dataset (relations, textures, counting, compare, ...)",
        description="Write DIR/train/CLASS/*.png and DIR/val/CLASS/*.png (32 x 32) of a generated task the "
        "project was not tuned on, to train with `layerswarm train --data imagefolder:DIR`. relations: where "
        "a circle is relative to a square and which is larger (a mirror swaps left and right: no flips); "
        "textures: stripes, diagonals, checks, dots, rings, blotches; faint-textures: the same classes in two "
        "close colours under heavy noise, turned by up to 15 degrees (far from the ceiling textures reaches); "
        "counting: 1-8 blobs; compare: two objects, the class says whether they share shape, colour and "
        "size (same-different questions, each learnt in a sudden jump if at all: runs often stop near 0.5 with "
        "one question at chance; docs/own-data.md). Deterministic from --seed.",
    )
    p.add_argument("task", choices=TASKS, help="which task")
    p.add_argument("dir", type=folder, help="folder to write into (created if missing)")
    p.add_argument("--train", type=positive_int, default=4000, help="training images (default: %(default)s)")
    p.add_argument("--val", type=non_negative_int, default=1000, help="validation images (default: %(default)s)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="generator seed (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from layerswarm.training.data.synthetic import write

    counts = write(args.task, args.dir, args.train, args.val, args.seed)
    print(f"{args.dir}: {counts['train']} training and {counts['val']} validation images of {args.task}")
    return 0
