#!/usr/bin/env bash
# Make the Debian base image for offline builds (no container registry): a minimal Debian root file
# system from the distribution's packages (debootstrap), with Python 3.11 and venv, as a tarball that
# `docker import` turns into an image. Debian 12's python3 is 3.11, so the cp311 wheels fit.
#
#   deploy/offline/make-base-image.sh ~/.cache/layerswarm/base.tar             # tarball only
#   deploy/offline/make-base-image.sh ~/.cache/layerswarm/base.tar layerswarm-base:bookworm  # and import it
#   docker build -f deploy/Dockerfile --build-arg BASE_IMAGE=layerswarm-base:bookworm \
#     --build-arg WHEELHOUSE=.wheelhouse -t layerswarm:cpu .
#
# Needs root and debootstrap (apt-get install debootstrap). SUITE (bookworm) and MIRROR
# (http://deb.debian.org/debian) pick the release and the package mirror, e.g. a local one.
# ARCH (the host's by default: amd64) picks Debian's architecture: ARCH=arm64 on an x86 machine runs
# debootstrap's first stage here and its second stage under emulation (qemu-user-static from Debian,
# registered with binfmt_misc's F flag: apt-get install qemu-user-static binfmt-support), and the
# image is labelled linux/arm64 (loaded as an image archive: deploy/offline/image_archive.py).
set -euo pipefail
out="${1:?usage: make-base-image.sh OUT.tar [IMAGE_TAG]}"
tag="${2:-}"
suite="${SUITE:-bookworm}"
mirror="${MIRROR:-http://deb.debian.org/debian}"
host_arch="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
arch="${ARCH:-$host_arch}"
# python3-venv brings ensurepip (the build stage makes a venv); nothing else is needed at run time:
# the wheels carry their own libraries (torch's libgomp, grpcio's C core), libstdc++ comes with apt.
packages="python3,python3-venv"

root="$(mktemp -d "${TMPDIR:-/tmp}/layerswarm-rootfs.XXXXXX")"
trap 'rm -rf "$root"' EXIT
echo "make-base-image: debootstrap $suite $arch (minbase + $packages) from $mirror"
if [ "$arch" = "$host_arch" ]; then
  debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
else
  # Another architecture: unpack here, configure under emulation (the kernel runs the foreign binaries
  # through qemu, registered with the F flag, so nothing needs copying into the root file system).
  grep -qs '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 /proc/sys/fs/binfmt_misc/qemu-"$arch" \
    || { echo "make-base-image: no binfmt_misc entry with the F flag for $arch (see deploy/offline/README.md)" >&2; exit 1; }
  debootstrap --arch="$arch" --foreign --variant=minbase --include="$packages" "$suite" "$root" "$mirror" \
    >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
  chroot "$root" /debootstrap/debootstrap --second-stage >>"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
fi
rm -f "$root.log"
# What an image does not need: package caches and lists, documentation, locales, man pages.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/log/*
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
mkdir -p "$(dirname "$out")"
tar --numeric-owner -C "$root" -cf "$out.partial" .
mv "$out.partial" "$out"
echo "make-base-image: wrote $out ($(du -h "$out" | cut -f1))"
if [ -n "$tag" ]; then
  # An image archive, not `docker import`: Docker 20.10 ignores import's --platform (image_archive.py).
  python3 "$(dirname "$0")/image_archive.py" "$out" "$tag" "$arch" | docker load >/dev/null
  echo "make-base-image: loaded as $tag ($arch)"
fi
