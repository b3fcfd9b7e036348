#!/usr/bin/env bash
# Reproduce the shipped text family in models/zoo/text with the project's own trainer (CPU, 2 cores shared
# with other work: about 25 minutes, and 25 more for the exit-aware stage). The base is a conventionally
# trained encoder (shipped as `baseline`: it collapses in arbitrary order); four LayerShuffle members are
# fine-tuned from it with different seeds (5 epochs), then each trained 3 more epochs at a lower rate, then 4
# more at a lower rate still (one family throughout: the last stage lifted arbitrary-order accuracy enough for
# the merged and ensemble targets), then 3 more with the early-exit loss (`--exit-loss 1.0`: exit-aware, so
# that calibrated early exit stops sooner; docs/adaptive.md). Evaluation, calibration and depth tables are
# written into staged copies in runs/text/zoo (eval and depth never write into the shipped zoo), which are
# then copied into the zoo; reports go to docs/results/zoo/text and docs/results/zoo/text-depth.
#
# A step whose model directory is finished (its manifest.json exists) is not redone. FROM_ZOO=1 starts at the
# exit-aware stage from the shipped members and baseline (exactly what the earlier steps made: each manifest
# records its command); it is refused once the shipped members are exit-aware already. UNTIL=train stops
# after training; DEPTH=tables makes layershuffle-0's per-token depth tables but not the text-depth member,
# DEPTH=0 neither (that member then stays as shipped: of the same family, made from an earlier layershuffle-0).
set -euo pipefail
cd "$(dirname "$0")/.."
L="${LAYERSWARM:-.venv/bin/layerswarm}"
WORK=runs/text
ZOO=models/zoo/text
STAGE="$WORK/zoo"
RESULTS=docs/results/zoo/text
export OMP_NUM_THREADS=1

finished() { [[ -f "$1/manifest.json" ]]; }
# Into the zoo by rename: copied whole beside it first, so no shipped directory is ever half-written.
install() {
  rm -rf "${2:?}.new" "$2.old" && cp -r "$1" "$2.new"
  if [[ -d "$2" ]]; then mv "$2" "$2.old"; fi
  mv "$2.new" "$2" && rm -rf "$2.old"
}
exit_aware() { grep -q '"exit_loss": [1-9]' "$1/manifest.json"; }
pids=()
wait_all() { for pid in "${pids[@]}"; do wait "$pid"; done; pids=(); }  # fails when any job failed

if [[ "${FROM_ZOO:-0}" == 1 ]]; then
  for i in 0 1 2 3; do
    if exit_aware "$ZOO/layershuffle-$i"; then echo "FROM_ZOO=1: $ZOO/layershuffle-$i is exit-aware already" >&2; exit 2; fi
    finished "$WORK/polished-$i" || { mkdir -p "$WORK" && cp -r "$ZOO/layershuffle-$i" "$WORK/polished-$i"; }
  done
  finished "$WORK/base" || cp -r "$ZOO/baseline" "$WORK/base"
fi
finished "$WORK/base" ||
  $L train --data words --variant baseline --out "$WORK/base" --epochs 12 --lr 3e-3 --threads 1 --seed 0
finished "$WORK/polished-3" || finished "$WORK/layershuffle-3" ||
  $L family --base "$WORK/base" --members 4 --out "$WORK" --prefix layershuffle --variant layershuffle \
    --epochs 5 --lr 3e-3 --jobs 2
for i in 0 1 2 3; do
  finished "$WORK/member-$i" || finished "$WORK/polished-$i" ||
    $L train --data words --variant layershuffle --init "$WORK/layershuffle-$i" --out "$WORK/member-$i" \
      --epochs 3 --lr 1e-3 --seed $((10 + i)) --threads 1 --overwrite &
  pids+=($!)
  if (( i % 2 == 1 )); then wait_all; fi
done
for i in 0 1 2 3; do
  finished "$WORK/polished-$i" ||
    $L train --data words --variant layershuffle --init "$WORK/member-$i" --out "$WORK/polished-$i" \
      --epochs 4 --lr 5e-4 --seed $((20 + i)) --threads 1 --no-reference --overwrite &
  pids+=($!)
  if (( i % 2 == 1 )); then wait_all; fi
done
# Exit-aware: each member fine-tuned with the early-exit loss added to LayerShuffle's (two at a time).
for i in 0 1 2 3; do
  finished "$WORK/exit-$i" ||
    $L train --data words --variant layershuffle --init "$WORK/polished-$i" --out "$WORK/exit-$i" \
      --epochs 3 --lr 5e-4 --warmup-steps 50 --seed $((30 + i)) --threads 1 --no-reference --exit-loss 1.0 \
      --overwrite &
  pids+=($!)
  if (( i % 2 == 1 )); then wait_all; fi
done
[[ "${UNTIL:-}" == train ]] && exit 0

mkdir -p "$ZOO" "$STAGE" "$RESULTS" "$RESULTS-depth"
for model in "$WORK"/exit-* "$WORK/base"; do
  name=$(basename "$model"); name=${name/exit/layershuffle}; name=${name/base/baseline}
  rm -rf "${STAGE:?}/$name"
  mkdir -p "$STAGE/$name"
  cp "$model"/manifest.json "$model"/tokenizer.json "$model"/*.safetensors "$STAGE/$name/"
done
$L eval "$STAGE"/layershuffle-* "$STAGE/baseline" --calibrate --json "$RESULTS/report.json" \
  --plots "$RESULTS/figures" | tee "$RESULTS/report.md"
# Per-token depth: tables for layershuffle-0 (MI; reconstruction from an anytime masked LM), then a copy of
# it fine-tuned one epoch WITH those reconstruction depths (frozen tokens, as the paper trains), measured
# in-process and through a loopback swarm.
if [[ "${DEPTH:-1}" != 0 ]]; then
  $L depth "$STAGE/layershuffle-0" --json "$RESULTS/depth.json" --sentences 300 --orders 3 --limit 1000
fi
for model in "$STAGE"/*; do install "$model" "$ZOO/$(basename "$model")"; done
[[ "${DEPTH:-1}" != 1 ]] && exit 0
$L train --data words --variant layershuffle --init "$ZOO/layershuffle-0" --token-depth reconstruction \
  --out "$WORK/depth-reconstruction" --epochs 1 --lr 1e-3 --warmup-steps 20 --seed 20 --threads 1 --overwrite
rm -rf "$WORK/depth-stage" && mkdir -p "$WORK/depth-stage" "$ZOO-depth"
cp "$WORK/depth-reconstruction"/{manifest.json,tokenizer.json} "$WORK/depth-reconstruction"/*.safetensors \
  "$WORK/depth-stage/"
install "$WORK/depth-stage" "$ZOO-depth/reconstruction"
$L depth "$ZOO-depth/reconstruction" --existing --orders 3 --limit 1000 --swarm 100 \
  --json "$RESULTS-depth/depth.json"
