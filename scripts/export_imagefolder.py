"""Write a dataset as an ImageNet-style folder of PNGs: OUT/train/<class>/*.png and OUT/val/<class>/*.png.

    python scripts/export_imagefolder.py --data digits --out runs/digits-folder

Used to check that the trainer's recipe holds on data it only sees through `imagefolder:PATH`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from layerswarm.training.data.datasets import load_dataset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a data spec (digits, shapes1:N:M, ...)")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    data = load_dataset(args.data, seed=args.data_seed)
    for split, xs, ys in (("train", data.train_x, data.train_y), ("val", data.test_x, data.test_y)):
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            folder = args.out / split / data.class_names[int(y)].replace("/", "_")
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (x.numpy().transpose(1, 2, 0) * 255).round().astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:05d}.png")
    print(f"wrote {len(data.train_y)} train and {len(data.test_y)} val images to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
