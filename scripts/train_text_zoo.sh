#!/usr/bin/env bash
# Reproduce the shipped text family in models/zoo/text with the project's own trainer (CPU, 2 cores
# shared with other work: about 25 minutes). The base is a conventionally trained encoder (shipped as
# `baseline`: it collapses in arbitrary order); four LayerShuffle members are fine-tuned from it with
# different seeds (5 epochs), then each trained 3 more epochs at a lower rate, then 4 more at a lower rate
# still (one family throughout: the last stage lifted arbitrary-order accuracy enough for the merged and
# ensemble targets). Evaluation and depth tables are written into staged copies in runs/text/zoo (eval and
# depth never write into the shipped zoo), which are then copied into the zoo; reports go to
# docs/results/zoo/text and docs/results/zoo/text-depth (results live outside the package).
set -euo pipefail
cd "$(dirname "$0")/.."
L="${LAYERSWARM:-.venv/bin/layerswarm}"
WORK=runs/text
ZOO=models/zoo/text
STAGE="$WORK/zoo"
RESULTS=docs/results/zoo/text
export OMP_NUM_THREADS=1

$L train --data words --variant baseline --out "$WORK/base" --epochs 12 --lr 3e-3 --threads 1 --seed 0
$L family --base "$WORK/base" --members 4 --out "$WORK" --prefix layershuffle --variant layershuffle \
  --epochs 5 --lr 3e-3 --jobs 2
for i in 0 1 2 3; do
  $L train --data words --variant layershuffle --init "$WORK/layershuffle-$i" --out "$WORK/member-$i" \
    --epochs 3 --lr 1e-3 --seed $((10 + i)) --threads 1 &
  if (( i % 2 == 1 )); then wait; fi
done
for i in 0 1 2 3; do
  $L train --data words --variant layershuffle --init "$WORK/member-$i" --out "$WORK/polished-$i" \
    --epochs 4 --lr 5e-4 --seed $((20 + i)) --threads 1 --no-reference &
  if (( i % 2 == 1 )); then wait; fi
done

mkdir -p "$ZOO" "$STAGE" "$RESULTS" "$RESULTS-depth"
for model in "$WORK"/polished-* "$WORK/base"; do
  name=$(basename "$model"); name=${name/polished/layershuffle}; name=${name/base/baseline}
  rm -rf "${STAGE:?}/$name"
  mkdir -p "$STAGE/$name"
  cp "$model"/manifest.json "$model"/tokenizer.json "$model"/*.safetensors "$STAGE/$name/"
done
$L eval "$STAGE"/layershuffle-* "$STAGE/baseline" --json "$RESULTS/report.json" | tee "$RESULTS/report.md"
# Per-token depth: tables for layershuffle-0 (MI; reconstruction from an anytime masked LM), then a copy of
# it fine-tuned one epoch WITH those reconstruction depths (frozen tokens, as the paper trains), measured
# in-process and through a loopback swarm.
$L depth "$STAGE/layershuffle-0" --json "$RESULTS/depth.json" --sentences 300 --orders 3 --limit 1000
for model in "$STAGE"/*; do
  rm -rf "${ZOO:?}/$(basename "$model")" && cp -r "$model" "$ZOO/"
done
$L train --data words --variant layershuffle --init "$ZOO/layershuffle-0" --token-depth reconstruction \
  --out "$WORK/depth-reconstruction" --epochs 1 --lr 1e-3 --warmup-steps 20 --seed 20 --threads 1
rm -rf "${ZOO:?}-depth/reconstruction" && mkdir -p "$ZOO-depth/reconstruction"
cp "$WORK/depth-reconstruction"/{manifest.json,tokenizer.json} "$WORK/depth-reconstruction"/*.safetensors \
  "$ZOO-depth/reconstruction/"
$L depth "$ZOO-depth/reconstruction" --existing --orders 3 --limit 1000 --swarm 100 \
  --json "$RESULTS-depth/depth.json"
