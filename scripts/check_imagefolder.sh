#!/usr/bin/env bash
# The zoo's recipe on data the trainer only sees as a class-per-folder image dataset (PNG files):
# scikit-learn's handwritten digits exported to folders, then the same steps as scripts/train_zoo.sh
# (a conventionally trained base, four LayerShuffle members fine-tuned from it, one baseline member)
# and the same evaluation. Report: docs/results/zoo/imagefolder-check/report.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
L="${LAYERSWARM:-.venv/bin/layerswarm}"
PY="${PYTHON:-.venv/bin/python}"
WORK=runs/imagefolder-check
OUT=docs/results/zoo/imagefolder-check
export OMP_NUM_THREADS=1

"$PY" scripts/export_imagefolder.py --data digits --out "$WORK/folder"
DATA="imagefolder:$WORK/folder"
$L train --data "$DATA" --variant baseline --out "$WORK/base" --epochs 16 --lr 3e-3 --depth 8 --threads 1 --seed 0
$L family --base "$WORK/base" --members 4 --out "$WORK" --prefix layershuffle --variant layershuffle \
  --epochs 12 --lr 3e-3 --jobs 2
$L train --data "$DATA" --variant baseline --init "$WORK/base" --out "$WORK/baseline" --epochs 1 --lr 1e-4 --seed 9 \
  --threads 1
mkdir -p "$OUT"
$L eval "$WORK"/layershuffle-* "$WORK/baseline" --json "$OUT/report.json" --plots "$OUT/figures" | tee "$OUT/report.md"
