#!/usr/bin/env bash
# Reproduce the shipped family in models/zoo/shapes with the project's own trainer (CPU, 2 cores:
# about 15 minutes). The base is a conventionally trained ViT; four LayerShuffle members are
# fine-tuned from it with different seeds (one family: their blocks can be mixed), and one baseline
# member is fine-tuned from it for one more epoch in order, as in the paper. Training and evaluation
# happen in runs/shapes (eval writes each model's minimum depth into its manifest, and never writes into the
# shipped zoo); the finished model directories (without training state) are then copied into the zoo, and
# the evaluation report and figures go to docs/results/zoo/shapes (results live outside the package).
set -euo pipefail
cd "$(dirname "$0")/.."
L="${LAYERSWARM:-.venv/bin/layerswarm}"
WORK=runs/shapes
ZOO=models/zoo/shapes
RESULTS=docs/results/zoo/shapes
export OMP_NUM_THREADS=1

$L train --data shapes --variant baseline --out "$WORK/base" --epochs 16 --lr 3e-3 --depth 8 --patch-size 8 --hflip \
  --threads 1 --seed 0
$L family --base "$WORK/base" --members 4 --out "$WORK" --prefix layershuffle --variant layershuffle \
  --epochs 12 --lr 3e-3 --jobs 2
$L train --data shapes --variant baseline --init "$WORK/base" --out "$WORK/baseline" --epochs 1 --lr 1e-4 --seed 9 \
  --hflip --threads 1

mkdir -p "$ZOO" "$RESULTS"
$L eval "$WORK"/layershuffle-* "$WORK/baseline" --json "$RESULTS/report.json" --plots "$RESULTS/figures" \
  | tee "$RESULTS/report.md"
for model in "$WORK"/layershuffle-* "$WORK/baseline"; do
  rm -rf "${ZOO:?}/$(basename "$model")"
  mkdir -p "$ZOO/$(basename "$model")"
  cp "$model"/manifest.json "$model"/*.safetensors "$ZOO/$(basename "$model")/"
done
