#!/usr/bin/env bash
# Install layerswarm on new devices over ssh, without root: a 64-bit Raspberry Pi OS board, a Jetson, any
# Linux with Python >= 3.10 (and python3-venv). On each device, under the login's home:
#   ~/layerswarm/venv    a venv with the lean node, layerswarm[node]: the numpy engine, no torch (a node
#                        in about 80 MB of RAM on a CPU board), no training or test tools
#   lingering on         `loginctl enable-linger`: its user services (the nodes) start at boot
# Then deploy/push-nodes.sh pushes blocks and starts nodes (push-nodes.sh --install runs this first).
#
#   deploy/install-board.sh pi-1.local pi-2.local pi-3.local
#   DRY_RUN=1 deploy/install-board.sh pi-1.local
#
# Environment:
#   SSH_USER, SSH_OPTS  as for push-nodes.sh (default login: yours; a HOST may be USER@HOST)
#   WHEEL        a layerswarm wheel to install (default: built here from this checkout, pip wheel)
#   EXTRAS       what to install with it (default: node, the lean node); node,torch adds torch for the torch
#                engine (a Jetson's CUDA: with VENV_ARGS=--system-site-packages JetPack's torch satisfies it)
#   PIP_ARGS     more pip options on the device: "--no-index --find-links /home/pi/wheels" offline; with
#                EXTRAS=node,torch on an x86 device, "--index-url https://download.pytorch.org/whl/cpu
#                --extra-index-url https://pypi.org/simple" for CPU torch (PyPI's x86 torch brings CUDA)
#   VENV_ARGS    more venv options: --system-site-packages keeps the system's torch (a Jetson's CUDA build)
#   PYTHON       the Python that builds the wheel here (default: python3)
#   DRY_RUN=1    print what would be done
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
die() { echo "install-board: $*" >&2; exit 2; }
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  -*) die "unknown option $1 (usage: install-board.sh HOST...)" ;;
  "") die "usage: install-board.sh HOST... (see the top of deploy/install-board.sh)" ;;
esac
ssh_user="${SSH_USER:-$(id -un)}"
if [ -z "${SSH_USER:-}" ] && [ "$ssh_user" = root ]; then
  die "you are root here: give the devices' login, SSH_USER=... (Raspberry Pi OS refuses root over ssh)"
fi
read -r -a ssh_opts <<< "${SSH_OPTS:-}"
read -r -a pip_args <<< "${PIP_ARGS:-}"
read -r -a venv_args <<< "${VENV_ARGS:-}"
extras="${EXTRAS:-node}"
case "$extras" in *[!a-z,]*) die "EXTRAS=$extras: extras are names like node or node,torch" ;; esac

wheel="${WHEEL:-}"
if [ -z "$wheel" ] && [ -z "${DRY_RUN:-}" ]; then
  built="$(mktemp -d)"
  trap 'rm -rf "$built"' EXIT
  echo "install-board: building a wheel of $(dirname "$here")" >&2
  "${PYTHON:-python3}" -m pip wheel -q --no-deps -w "$built" "$(dirname "$here")" >&2 || die "pip wheel failed (above)"
  wheel="$(ls "$built"/layerswarm-*.whl)"
fi
if [ -n "$wheel" ]; then
  [ -f "$wheel" ] || die "WHEEL=$wheel: no such file"
  case "$(basename "$wheel")" in layerswarm-*.whl) ;; *) die "WHEEL=$wheel: not a layerswarm wheel" ;; esac
fi
wheel_name="$(basename "${wheel:-layerswarm-VERSION-py3-none-any.whl}")"

# Run on the device by `bash -s`: its settings first (declare -p quotes them for bash), then this body.
body="$(cat <<'REMOTE'
set -eu
fail() { echo "$*" >&2; exit 3; }
case "$(uname -m)" in
  aarch64|arm64|x86_64) ;;
  *) fail "$(uname -m) is a 32-bit system: layerswarm's wheels (numpy, grpcio) need a 64-bit OS (Raspberry Pi OS 64-bit)" ;;
esac
command -v python3 >/dev/null || fail "no python3 (sudo apt install python3 python3-venv)"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || fail "$(python3 -V) is older than 3.10"
venv="$HOME/layerswarm/venv"
had_layerswarm=""; [ -x "$venv/bin/layerswarm" ] && had_layerswarm=1
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv ${venv_args[@]+"${venv_args[@]}"} "$venv" </dev/null \
    || fail "python3 -m venv failed (Debian, Raspberry Pi OS: sudo apt install python3-venv)"
fi
wheel="$HOME/layerswarm/dist/$wheel_name"
"$venv/bin/python" -m pip install -q ${pip_args[@]+"${pip_args[@]}"} "${wheel}[${extras}]" </dev/null
# The same version number again is "already satisfied": put this wheel's code in place all the same.
[ -z "$had_layerswarm" ] || "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel" </dev/null
"$venv/bin/layerswarm" node --help </dev/null >/dev/null || fail "the installed layerswarm does not start (above)"
loginctl enable-linger "$(id -un)" </dev/null \
  || echo "loginctl enable-linger failed: nodes start when you log in, not at boot" >&2
echo "layerswarm installed in $venv ($("$venv/bin/python" -c 'import platform; print(platform.python_version())'), $(uname -m))"
REMOTE
)"
settings="$(declare -p wheel_name pip_args venv_args extras)"

status=0
for host in "$@"; do
  case "$host" in *@*) target="$host" ;; *) target="$ssh_user@$host" ;; esac
  echo "== $target: install layerswarm[$extras] from $wheel_name"
  if [ -n "${DRY_RUN:-}" ]; then
    echo "+ ssh ${SSH_OPTS:-} $target 'mkdir -p ~/layerswarm/dist && cat > ~/layerswarm/dist/$wheel_name' < WHEEL"
    echo "+ ssh ${SSH_OPTS:-} $target bash -s <<< '$settings; <venv, pip install, enable-linger>'"
    continue
  fi
  if ssh ${ssh_opts[@]+"${ssh_opts[@]}"} -- "$target" \
      "mkdir -p ~/layerswarm/dist && cat > ~/layerswarm/dist/$wheel_name" < "$wheel" \
    && printf '%s\n%s\n' "$settings" "$body" | ssh ${ssh_opts[@]+"${ssh_opts[@]}"} -- "$target" bash -s; then
    continue
  fi
  echo "install-board: $target: install failed (above)" >&2
  status=1
done
exit "$status"
