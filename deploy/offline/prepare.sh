#!/usr/bin/env bash
# Make the offline image inputs where they are missing: the debootstrap base image's tarball (in
# ~/.cache/layerswarm, LAYERSWARM_CACHE to change) and the wheelhouses: .wheelhouse (the CPU image:
# torch, the coordinator) and .wheelhouse-node (the lean node image, no torch). Both need the network
# (the Debian mirror, the package index), so this runs before, and outside, the private network
# namespace the Docker test runs in; so are .debs-haproxy (the load balancer image's HAProxy packages).
# The seconds each step took go to runs/docker/prepare.json (base image: null when it was already
# there), which the test copies into its figures.
#
# ARM64=1 also makes the arm64 inputs of the lean node (tests/deploy/test_arm64.py): an arm64 base tarball
# (debootstrap's second stage under qemu-user-static, registered with binfmt_misc here when it is
# not: needs root, apt-get install qemu-user-static binfmt-support) and .wheelhouse-node-aarch64.
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
EXTRAS='' deploy/offline/make-wheelhouse.sh .wheelhouse-node
wheels_s=$SECONDS
# HAProxy for the load balancer image (deploy/Dockerfile.haproxy): the base has no haproxy, so its .deb
# and the libraries the base lacks are downloaded here, once, and installed with dpkg at build time.
SECONDS=0
debs_s=null
if ! ls .debs-haproxy/haproxy_*.deb >/dev/null 2>&1; then
  deploy/offline/make-debs.sh .debs-haproxy haproxy
  debs_s=$SECONDS
fi
arm64_s=null
if [ "${ARM64:-}" = 1 ]; then  # optional: without them tests/deploy/test_arm64.py skips, the rest goes on
  SECONDS=0
  if deploy/offline/enable-arm64-emulation.sh \
    && { [ -f "$cache/base-bookworm-arm64.tar" ] \
         || ARCH=arm64 deploy/offline/make-base-image.sh "$cache/base-bookworm-arm64.tar"; } \
    && EXTRAS='' ARCH=aarch64 deploy/offline/make-wheelhouse.sh .wheelhouse-node-aarch64; then
    arm64_s=$SECONDS
  else
    echo "prepare: arm64 inputs unavailable (above): tests/deploy/test_arm64.py will skip" >&2
  fi
fi
mkdir -p runs/docker
printf '{"base_tarball_seconds": %s, "wheelhouse_seconds": %s, "haproxy_debs_seconds": %s, "arm64_seconds": %s, "date": "%s"}\n' \
  "$base_s" "$wheels_s" "$debs_s" "$arm64_s" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > runs/docker/prepare.json
echo "prepare: base image tarball $tarball, wheelhouse .wheelhouse ready"
