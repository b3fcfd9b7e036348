#!/usr/bin/env python3
"""Write a root file system tarball as an image archive that `docker load` reads, with its architecture.

`docker import --platform` is ignored by Docker 20.10 (Debian 12's engine): an arm64 root file system
imported that way is labelled amd64, and builds on it are refused or mislabelled. An image archive
(docker save's layout: one layer, a config naming os and architecture, a manifest) carries the label.

    python3 deploy/offline/image_archive.py ROOTFS.tar TAG ARCH | docker load
    python3 deploy/offline/image_archive.py ~/.cache/layerswarm/base-bookworm-arm64.tar \\
        layerswarm-base:bookworm-arm64 arm64 | docker load
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_archive(rootfs: Path, tag: str, arch: str, out: io.BufferedIOBase) -> None:
    layer = sha256_of(rootfs)  # an uncompressed tar: its digest is the layer's diff id
    config = {
        "architecture": arch,
        "os": "linux",
        "config": {"Env": ENV, "Cmd": ["/bin/bash"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer}"]},
        "history": [{"created_by": f"debootstrap root file system ({rootfs.name})"}],
    }
    config_bytes = json.dumps(config).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": [f"{layer}/layer.tar"]}]
    with tarfile.open(fileobj=out, mode="w|") as archive:
        for name, data in ((config_name, config_bytes), ("manifest.json", json.dumps(manifest).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        archive.add(str(rootfs), arcname=f"{layer}/layer.tar")


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 2
    rootfs, tag, arch = Path(argv[0]), argv[1], argv[2]
    if not rootfs.is_file():
        print(f"image_archive: {rootfs}: no such file", file=sys.stderr)
        return 2
    write_archive(rootfs, tag, arch, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
