#!/usr/bin/env bash
# Push blocks to edge devices over ssh and start them as systemd services.
#
#   deploy/push-nodes.sh deploy/plan.example.txt            # do it
#   DRY_RUN=1 deploy/push-nodes.sh deploy/plan.example.txt  # print the commands only
#
# Each plan line: HOST BLOCK MODEL_DIR DEVICE PORT (see plan.example.txt; deploy/make_plan.py writes one
# from the devices' memory). Only the manifest and the one block file travel: a node verifies that
# block's sha256 against the manifest before it serves. Devices need layerswarm installed in
# /opt/layerswarm (pip, or the Jetson image) and a `layerswarm` user; SSH_USER defaults to root.
set -euo pipefail
plan="${1:?usage: push-nodes.sh PLAN_FILE}"
ssh_user="${SSH_USER:-root}"
unit="$(dirname "$0")/systemd/layerswarm-node@.service"

run() { if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi; }

grep -v '^\s*#' "$plan" | grep -v '^\s*$' | while read -r host block model_dir device port; do
  [ -f "$model_dir/manifest.json" ] || { echo "push-nodes: $model_dir has no manifest.json" >&2; exit 2; }
  block_file=$(printf "block_%02d.safetensors" "$block")
  [ -f "$model_dir/$block_file" ] || { echo "push-nodes: $model_dir has no $block_file" >&2; exit 2; }
  model=$(basename "$model_dir")
  remote_dir="/var/lib/layerswarm/models/$model"
  target="$ssh_user@$host"
  echo "== $host: block $block of $model on $device, port $port"
  run ssh "$target" "mkdir -p $remote_dir /etc/layerswarm"
  run scp -q "$model_dir/manifest.json" "$model_dir/$block_file" "$target:$remote_dir/"
  run scp -q "$unit" "$target:/etc/systemd/system/layerswarm-node@.service"
  env_file="LAYERSWARM_MODEL_DIR=$remote_dir
LAYERSWARM_DEVICE=$device
LAYERSWARM_PORT=$port
LAYERSWARM_ARGS=--metrics-port $((port + 1000))"
  run ssh "$target" "printf '%s\n' '$env_file' > /etc/layerswarm/node-$block.env && systemctl daemon-reload && systemctl enable --now layerswarm-node@$block && systemctl restart layerswarm-node@$block"
done
