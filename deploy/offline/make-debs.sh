#!/usr/bin/env bash
# Download Debian packages, with exactly the dependencies the offline base image lacks, for an image layer
# that installs them with dpkg and no network: HAProxy for the load balancer image (deploy/Dockerfile.haproxy).
#
#   deploy/offline/make-debs.sh .debs-haproxy haproxy        # haproxy and 3 libraries, about 2 MB
#   docker build -f deploy/Dockerfile.haproxy --build-arg BASE_IMAGE=layerswarm-base:bookworm \
#     --build-arg DEBS=.debs-haproxy -t layerswarm-lb:haproxy .
#
# The dependency closure is computed against the base itself: its root file system (the tarball that
# make-base-image.sh wrote) is unpacked into a temporary directory and apt-get runs there, in a chroot,
# with --download-only, so the set fits that base whatever the host's distribution. Needs root and the
# Debian mirror (the base's own sources); the directory must sit inside the build context.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: make-debs.sh OUT_DIR PACKAGE...}"
shift
[ "$#" -gt 0 ] || { echo "make-debs: name at least one package" >&2; exit 2; }
cache="${LAYERSWARM_CACHE:-$HOME/.cache/layerswarm}"
tarball="${BASE_TARBALL:-$cache/base-bookworm.tar}"
[ -f "$tarball" ] || { echo "make-debs: no base tarball at $tarball (deploy/offline/make-base-image.sh)" >&2; exit 1; }
root="$(mktemp -d "${TMPDIR:-/tmp}/layerswarm-debs.XXXXXX")"
trap 'rm -rf "$root"' EXIT
tar -C "$root" -xf "$tarball"
cp /etc/resolv.conf "$root/etc/resolv.conf"
if ! { chroot "$root" apt-get update -q \
       && chroot "$root" apt-get install -y -q --download-only --no-install-recommends "$@"; } >"$root.log" 2>&1; then
  tail -20 "$root.log" >&2
  rm -f "$root.log"
  exit 1
fi
rm -f "$root.log"
mkdir -p "$out"
rm -f "$out"/*.deb
cp "$root"/var/cache/apt/archives/*.deb "$out/"
echo "make-debs: $(find "$out" -name '*.deb' | wc -l) packages in $out ($(du -sh "$out" | cut -f1)): $*"
