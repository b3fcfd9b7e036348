#!/usr/bin/env bash
# Reproduce the shipped family in models/zoo/shapes with the project's own trainer (CPU, 2 cores: about
# 15 minutes idle, two to three times that on a shared machine). The base is a conventionally trained ViT;
# four LayerShuffle members are fine-tuned from it with different seeds (one family: their blocks can be
# mixed), then each is fine-tuned once more with the early-exit loss (`--exit-loss 2.0`, and no label
# smoothing, which capped the head's confidence near 0.9 and blunted the exit rules: exit-aware, so that
# calibrated early exit stops sooner; docs/adaptive.md); one baseline member is fine-tuned from the base
# for one more epoch in order, as in the paper. Training and evaluation happen in runs/shapes: the
# finished model directories (without training state) are staged in runs/shapes/zoo, evaluated and
# calibrated there (eval writes each model's minimum depth and adaptive.json, and never writes into the
# shipped zoo), then copied into the zoo; the report and figures go to docs/results/zoo/shapes.
#
# A step whose model directory is finished (its manifest.json exists) is not redone, so an interrupted
# run picks up where it stopped. FROM_ZOO=1 starts at the exit-aware stage from the shipped LayerShuffle
# members and baseline (exactly what the earlier steps made: each manifest records its command); it is
# refused once the shipped members are exit-aware already. UNTIL=train stops after training.
set -euo pipefail
cd "$(dirname "$0")/.."
L="${LAYERSWARM:-.venv/bin/layerswarm}"
WORK=runs/shapes
ZOO=models/zoo/shapes
STAGE="$WORK/zoo"
RESULTS=docs/results/zoo/shapes
export OMP_NUM_THREADS=1

finished() { [[ -f "$1/manifest.json" ]]; }
# Into the zoo by rename: copied whole beside it first, so no shipped directory is ever half-written.
install() {
  rm -rf "${2:?}.new" "$2.old" && cp -r "$1" "$2.new"
  if [[ -d "$2" ]]; then mv "$2" "$2.old"; fi
  mv "$2.new" "$2" && rm -rf "$2.old"
}
pids=()
wait_all() { for pid in "${pids[@]}"; do wait "$pid"; done; pids=(); }  # fails when any job failed
exit_aware() { grep -q '"exit_loss": [1-9]' "$1/manifest.json"; }

if [[ "${FROM_ZOO:-0}" == 1 ]]; then
  for model in "$ZOO"/layershuffle-* "$ZOO/baseline"; do
    if exit_aware "$model"; then echo "FROM_ZOO=1: $model is exit-aware already" >&2; exit 2; fi
    finished "$WORK/$(basename "$model")" || { mkdir -p "$WORK" && cp -r "$model" "$WORK/"; }
  done
fi
finished "$WORK/base" || finished "$WORK/layershuffle-3" ||
  $L train --data shapes --variant baseline --out "$WORK/base" --epochs 16 --lr 3e-3 --depth 8 --patch-size 8 \
    --hflip --threads 1 --seed 0
finished "$WORK/layershuffle-3" ||
  $L family --base "$WORK/base" --members 4 --out "$WORK" --prefix layershuffle --variant layershuffle \
    --epochs 12 --lr 3e-3 --jobs 2
finished "$WORK/baseline" ||
  $L train --data shapes --variant baseline --init "$WORK/base" --out "$WORK/baseline" --epochs 1 --lr 1e-4 \
    --seed 9 --hflip --threads 1
# Exit-aware: each member fine-tuned with the early-exit loss added to LayerShuffle's (two at a time).
for i in 0 1 2 3; do
  finished "$WORK/exit-$i" ||
    $L train --data shapes --variant layershuffle --init "$WORK/layershuffle-$i" --out "$WORK/exit-$i" \
      --epochs 5 --lr 5e-4 --warmup-steps 50 --seed $((30 + i)) --hflip --threads 1 --no-reference \
      --exit-loss 2.0 --label-smoothing 0 --overwrite &
  pids+=($!)
  if (( i % 2 == 1 )); then wait_all; fi
done
[[ "${UNTIL:-}" == train ]] && exit 0

mkdir -p "$STAGE" "$RESULTS"
for model in "$WORK"/exit-* "$WORK/baseline"; do
  name=$(basename "$model"); name=${name/exit/layershuffle}
  rm -rf "${STAGE:?}/$name" && mkdir -p "$STAGE/$name"
  cp "$model"/manifest.json "$model"/*.safetensors "$STAGE/$name/"
done
$L eval "$STAGE"/layershuffle-* "$STAGE/baseline" --calibrate --json "$RESULTS/report.json" \
  --plots "$RESULTS/figures" | tee "$RESULTS/report.md"
for model in "$STAGE"/*; do install "$model" "$ZOO/$(basename "$model")"; done
