#!/usr/bin/env bash
# The own-data comparison of docs/own-data.md, rerunnable: for one generated task (relations, textures or
# counting) at one training-set size, write the PNG folders, train with the bare default command
# (LayerShuffle ViT after an in-order ramp, conv stem, 600 s step schedule, early stopping, reference CNN
# for the same time),
# and with FAMILY=1 also fine-tune a family from it (`layerswarm family`, defaults), train a
# conventional baseline with the default command, and evaluate the family targets (`layerswarm eval`).
# Usage: scripts/own_data_check.sh TASK TRAIN_IMAGES WORKDIR      (FAMILY=1 for the family part)
# Everything lands in WORKDIR/TASK-N/: data/, base/, members, baseline/, report.json, logs. Then
#   python -m layerswarm.bench.own_data WORKDIR --json docs/results/own-data.json --markdown docs/results/own-data.md
# The run docs/own-data.md quotes: two streams side by side, each pinned to one core (taskset -c 0 / -c 1):
#   for t in relations textures counting; do FAMILY=1 scripts/own_data_check.sh $t 4000 WORK; done
#   for t in relations textures counting; do scripts/own_data_check.sh $t 20000 WORK; done
# With SIZES, the size ladder instead (docs/results/own-data-size.json): the default command with
# --no-reference --threads 1 and each size, a name (`--size small`) or DxBLOCKS (`--dim D --depth BLOCKS`,
# 16 channels a head), into WORK/TASK-N/size-S/; then
#   python -m layerswarm.bench.own_data --runs WORK/*/size-* --json docs/results/own-data-size.json
#   SIZES="48x4 64x6 96x6 64x8" scripts/own_data_check.sh relations 4000 WORK   # taskset -c 0 / -c 1 as above
set -euo pipefail
TASK="$1"; N="$2"; WORK="$3/$TASK-$N"
L="${LAYERSWARM:-$(dirname "$0")/../.venv/bin/layerswarm}"
mkdir -p "$WORK"
stamp() { date -u +%s; }
t0=$(stamp)
[ -d "$WORK/data/train" ] || "$L" datasets "$TASK" "$WORK/data" --train "$N" --val 1000 >"$WORK/datasets.log" 2>&1
t1=$(stamp)
if [ -n "${SIZES:-}" ]; then
  for size in $SIZES; do
    case "$size" in
      *x*) flags=(--dim "${size%x*}" --depth "${size#*x}" --heads $((${size%x*} / 16))) ;;
      *) flags=(--size "$size") ;;
    esac
    [ -f "$WORK/size-$size/manifest.json" ] || "$L" train --data "imagefolder:$WORK/data" --out "$WORK/size-$size" \
      --no-reference --threads 1 "${flags[@]}" >"$WORK/size-$size.log" 2>&1
  done
  echo "done: $WORK"
  exit 0
fi
[ -f "$WORK/base/manifest.json" ] || "$L" train --data "imagefolder:$WORK/data" --out "$WORK/base" >"$WORK/base.log" 2>&1
t2=$(stamp)
echo "{\"task\": \"$TASK\", \"train_images\": $N, \"datasets_s\": $((t1 - t0)), \"base_s\": $((t2 - t1))}" >"$WORK/times.json"
if [ "${FAMILY:-0}" = 1 ]; then
  [ -f "$WORK/layershuffle-3/manifest.json" ] || "$L" family --base "$WORK/base" --out "$WORK" --prefix layershuffle >"$WORK/family.log" 2>&1
  t3=$(stamp)
  [ -f "$WORK/baseline/manifest.json" ] || "$L" train --data "imagefolder:$WORK/data" --variant baseline --no-reference \
    --out "$WORK/baseline" >"$WORK/baseline.log" 2>&1
  t4=$(stamp)
  "$L" eval "$WORK"/layershuffle-* "$WORK/baseline" --json "$WORK/report.json" --plots "$WORK/figures" >"$WORK/report.md" 2>"$WORK/eval.log"
  t5=$(stamp)
  echo "{\"task\": \"$TASK\", \"train_images\": $N, \"datasets_s\": $((t1 - t0)), \"base_s\": $((t2 - t1)), \"family_s\": $((t3 - t2)), \"baseline_s\": $((t4 - t3)), \"eval_s\": $((t5 - t4))}" >"$WORK/times.json"
fi
echo "done: $WORK"
