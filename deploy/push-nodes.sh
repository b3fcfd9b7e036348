#!/usr/bin/env bash
# Provision a plan's nodes over ssh and (re)start them as systemd user services: no root on the devices.
#
#   deploy/push-nodes.sh --install plan.txt   # a new device: install layerswarm first (deploy/install-board.sh)
#   deploy/push-nodes.sh plan.txt             # push every node of the plan and (re)start it
#   DRY_RUN=1 deploy/push-nodes.sh plan.txt   # print what would be done, change nothing
#
# A plan line is HOST BLOCK MODEL_DIR DEVICE PORT (deploy/make_plan.py writes plans; HOST may be USER@HOST).
# The plan is checked whole before anything is sent (deploy/make_plan.py --check). For each line, one ssh
# connection carries the model's manifest and that one block file (the node verifies its sha256 against
# the manifest before serving), the swarm token, the node's settings and the unit template, then enables
# and restarts the node's unit. On the device, under the login's home:
#   ~/layerswarm/models/<model id>/      manifest.json and the block files this device serves
#   ~/layerswarm/nodes/<model id>-bNN.env the node's settings (LAYERSWARM_NODE_* variables)
#   ~/layerswarm/swarm.token             the swarm token (mode 600)
#   ~/.config/systemd/user/layerswarm-node@.service, instance layerswarm-node@<model id>-bNN
# A device that fails is reported and the others are still provisioned; the exit status says if any failed.
#
# Environment:
#   SSH_USER           the devices' login (default: yours, $(id -un); refused when that is root: give it)
#   SSH_OPTS           more ssh options, e.g. "-i ~/.ssh/id_ed25519" or "-F lab_ssh_config"
#   TOKEN_FILE         the swarm token (default: ./swarm.token, made when missing); the coordinator takes
#                      the same file: --token-file swarm.token
#   ADVERTISE_ADDRESS  an interface (wlan0) or address every node advertises (default: the node's route
#                      to the LAN; see docs/home-lan.md)
#   PYTHON             the Python that runs make_plan.py --check (default: python3)
#   DRY_RUN=1          print the commands and the files, run nothing
set -euo pipefail
export COPYFILE_DISABLE=1  # macOS tar: no AppleDouble ._ files in what is sent
here="$(cd "$(dirname "$0")" && pwd)"
usage="usage: push-nodes.sh [--install] PLAN_FILE (see the top of deploy/push-nodes.sh)"
die() { echo "push-nodes: $*" >&2; exit 2; }

install=""
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  --install) install=1; shift ;;
  -*) die "unknown option ${1} ($usage)" ;;
esac
[ $# -eq 1 ] || die "$usage"
plan="$1"
python="${PYTHON:-python3}"
command -v "$python" >/dev/null || die "PYTHON=$python: not found (it runs deploy/make_plan.py --check)"
ssh_user="${SSH_USER:-$(id -un)}"
if [ -z "${SSH_USER:-}" ] && [ "$ssh_user" = root ]; then
  die "you are root here: give the devices' login, SSH_USER=... (Raspberry Pi OS refuses root over ssh)"
fi
read -r -a ssh_opts <<< "${SSH_OPTS:-}"
token_file="${TOKEN_FILE:-swarm.token}"
advertise="${ADVERTISE_ADDRESS:-}"
case "$advertise" in *[!A-Za-z0-9._:-]*) die "ADVERTISE_ADDRESS=$advertise: not an interface name or address" ;; esac

rows="$("$python" "$here/make_plan.py" --check "$plan")" || exit 2  # it printed the line at fault

if [ ! -s "$token_file" ]; then
  if [ -n "${DRY_RUN:-}" ]; then
    echo "+ make a swarm token in $token_file"
  else
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$token_file")
    echo "push-nodes: made a new swarm token in $token_file (the coordinator needs --token-file $token_file)" >&2
  fi
fi

target_of() { case "$1" in *@*) echo "$1" ;; *) echo "$ssh_user@$1" ;; esac; }

if [ -n "$install" ]; then
  targets=()
  while read -r host; do targets+=("$(target_of "$host")"); done < <(awk '!seen[$1]++ {print $1}' <<< "$rows")
  SSH_USER="$ssh_user" "$here/install-board.sh" "${targets[@]}" || die "install failed: no node was pushed"
fi

stage_root="$(mktemp -d)"
trap 'rm -rf "$stage_root"' EXIT
failed=()
while read -r host block model_dir device port model_id <&3; do
  target="$(target_of "$host")"
  instance="$(printf '%s-b%02d' "$model_id" "$block")"
  block_file="$(printf 'block_%02d.safetensors' "$block")"
  stage="$stage_root/$instance@$host"
  mkdir -p "$stage/layerswarm/models/$model_id" "$stage/layerswarm/nodes" "$stage/.config/systemd/user"
  cp "$model_dir/manifest.json" "$model_dir/$block_file" "$stage/layerswarm/models/$model_id/"
  cp "$here/systemd/layerswarm-node@.service" "$stage/.config/systemd/user/"
  if [ -s "$token_file" ]; then install -m 600 "$token_file" "$stage/layerswarm/swarm.token"; fi
  {
    echo "# block $block of $(basename "$model_dir") ($model_id), written by deploy/push-nodes.sh"
    echo "LAYERSWARM_NODE_MODEL_DIR=models/$model_id"
    echo "LAYERSWARM_NODE_BLOCK=$block"
    echo "LAYERSWARM_NODE_HOST=0.0.0.0"
    echo "LAYERSWARM_NODE_PORT=$port"
    echo "LAYERSWARM_NODE_DEVICE=$device"
    echo "LAYERSWARM_NODE_METRICS_PORT=$((port + 1000))"
    echo "LAYERSWARM_NODE_TOKEN_FILE=swarm.token"
    [ -z "$advertise" ] || echo "LAYERSWARM_NODE_ADVERTISE_ADDRESS=$advertise"
  } > "$stage/layerswarm/nodes/$instance.env"
  unit="layerswarm-node@$instance"
  remote="umask 077 && [ -x ~/layerswarm/venv/bin/layerswarm ] \
|| { echo 'layerswarm is not installed in ~/layerswarm/venv: push-nodes.sh --install' >&2; exit 3; } \
&& tar --no-overwrite-dir -C ~ -xf - && systemctl --user daemon-reload && systemctl --user enable $unit \
&& systemctl --user restart $unit"
  echo "== $target: block $block of $(basename "$model_dir") on $device, port $port ($unit)"
  if [ -n "${DRY_RUN:-}" ]; then
    (cd "$stage" && find . -type f | sort | sed 's|^\./|   ~/|')
    sed 's/^/   | /' "$stage/layerswarm/nodes/$instance.env"
    echo "+ tar -C STAGE -cf - layerswarm .config | ssh ${SSH_OPTS:-} $target '$remote'"
  elif ! tar -C "$stage" -cf - layerswarm .config | ssh ${ssh_opts[@]+"${ssh_opts[@]}"} -- "$target" "$remote"; then
    echo "push-nodes: $target: block $block of $(basename "$model_dir") failed (above)" >&2
    failed+=("$host:$block")
  fi
done 3<<< "$rows"

if [ ${#failed[@]} -gt 0 ]; then
  echo "push-nodes: ${#failed[@]} node(s) not started: ${failed[*]}" >&2
  exit 1
fi
if [ -n "${DRY_RUN:-}" ]; then echo "push-nodes: dry run, nothing sent"; exit 0; fi
echo "push-nodes: every node of $plan pushed; start the coordinator with --token-file $token_file"
