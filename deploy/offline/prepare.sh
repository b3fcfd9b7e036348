#!/usr/bin/env bash
# Make the offline image inputs where they are missing: the debootstrap base image's tarball (in
# ~/.cache/layerswarm, LAYERSWARM_CACHE to change) and the wheelhouse (.wheelhouse). Both need the
# network (the Debian mirror, the package index), so this runs before, and outside, the private
# network namespace the Docker test runs in. The seconds each step took go to runs/docker/prepare.json
# (base image: null when it was already there), which the test copies into its figures.
set -euo pipefail
cd "$(dirname "$0")/../.."
cache="${LAYERSWARM_CACHE:-$HOME/.cache/layerswarm}"
tarball="$cache/base-bookworm.tar"
base_s=null
wheels_s=null
if [ ! -f "$tarball" ]; then
  SECONDS=0
  deploy/offline/make-base-image.sh "$tarball"
  base_s=$SECONDS
fi
# Always: pip keeps the wheels already there and fetches only what pyproject.toml added since.
SECONDS=0
deploy/offline/make-wheelhouse.sh .wheelhouse
wheels_s=$SECONDS
mkdir -p runs/docker
printf '{"base_tarball_seconds": %s, "wheelhouse_seconds": %s, "date": "%s"}\n' \
  "$base_s" "$wheels_s" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > runs/docker/prepare.json
echo "prepare: base image tarball $tarball, wheelhouse .wheelhouse ready"
