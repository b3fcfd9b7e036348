#!/usr/bin/env bash
# Let this x86 machine run arm64 programs (debootstrap's second stage, the arm64 node image): Debian's
# qemu-user-static, registered with binfmt_misc with the F flag (the kernel keeps the interpreter open,
# so containers and chroots need no copy of it). Needs root; changes nothing when already registered.
set -euo pipefail
entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
if grep -qs '^flags: .*F' "$entry"; then
  echo "enable-arm64-emulation: qemu-aarch64 already registered (F flag)"
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "enable-arm64-emulation: needs root" >&2; exit 1; }
if ! command -v qemu-aarch64-static >/dev/null 2>&1 || ! command -v update-binfmts >/dev/null 2>&1; then
  apt-get install -y -q --no-install-recommends qemu-user-static binfmt-support >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends qemu-user-static binfmt-support >/dev/null; }
fi
[ -f /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
grep -qs '^flags: .*F' "$entry" || { echo "enable-arm64-emulation: qemu-aarch64 not registered with F" >&2; exit 1; }
echo "enable-arm64-emulation: qemu-aarch64 registered (F flag)"
