"""A private Docker engine for tests: dockerd started here, in this process's private network namespace
(scripts/test runs pytest under `unshare -n`), with its own data root, socket and exec root in a
temporary directory, stopped by its PID and removed afterwards. Nothing it does can reach a real
interface: `start` refuses to run where one is visible.

The offline image inputs (the debootstrap base image's tarball and the wheelhouse) are made beforehand,
with the network, by deploy/offline/prepare.sh; missing ones skip the test with that advice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerswarm.harness.netns import in_private_netns

ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE = "layerswarm-base:bookworm"
WHEELHOUSE = ".wheelhouse"  # inside the build context (the repository root), gitignored
CACHE = Path(os.environ.get("LAYERSWARM_CACHE", Path.home() / ".cache" / "layerswarm"))


class EngineUnavailable(RuntimeError):
    """No Docker engine can run here; the message says why (the test skips with it)."""


def docker_cli() -> str:
    # Debian's CLI matches Debian's engine; another CLI on PATH may be far newer than the daemon.
    return "/usr/bin/docker" if Path("/usr/bin/docker").is_file() else (shutil.which("docker") or "docker")


def compose_cli(env: dict[str, str]) -> list[str]:
    """`docker compose` (v2 plugin) where it works, else `docker-compose` (v1, Debian or PyPI)."""
    v2 = subprocess.run([docker_cli(), "compose", "version"], capture_output=True, env=env, check=False)
    if v2.returncode == 0:
        return [docker_cli(), "compose"]
    v1 = shutil.which("docker-compose")
    if v1 is None:
        raise EngineUnavailable("neither `docker compose` nor `docker-compose` is installed")
    return [v1]


def why_no_engine() -> str | None:
    if os.geteuid() != 0:
        return "dockerd needs root"
    missing = [tool for tool in ("dockerd", "containerd", "runc") if shutil.which(tool) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install docker.io)"
    if not in_private_netns():
        return "refusing to start dockerd where a real network interface is visible: run under scripts/test"
    return None


@dataclass
class Engine:
    pid: int
    home: Path
    popen: subprocess.Popen[bytes]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.home}/sock"}

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        result = subprocess.run(
            [docker_cli(), *args], capture_output=True, text=True, env=self.env, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {result.stderr.strip()[-2000:]}")
        return result.stdout

    def inspect(self, *names: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = json.loads(self.docker("inspect", *names))
        return out

    def log_tail(self) -> str:
        return (self.home / "dockerd.log").read_text(errors="replace")[-3000:]


def start(timeout: float = 60.0) -> Engine:
    reason = why_no_engine()
    if reason:
        raise EngineUnavailable(reason)
    # A short path: containerd's socket paths must fit in 108 bytes.
    home = Path(tempfile.mkdtemp(prefix="lsd-", dir="/tmp"))
    cmd = [
        "dockerd",
        f"--data-root={home}/root",
        f"--exec-root={home}/e",
        f"--pidfile={home}/pid",
        f"--host=unix://{home}/sock",
        "--iptables=false",  # no rules in any table; the namespace is ours anyway
        "--ip-masq=false",
    ]
    with (home / "dockerd.log").open("wb") as log:
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine(popen.pid, home, popen)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and popen.poll() is None:
        probe = subprocess.run(
            [docker_cli(), "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            env=engine.env,
            check=False,
        )
        if probe.returncode == 0:
            return engine
        time.sleep(0.5)
    tail = engine.log_tail()
    stop(engine)
    raise EngineUnavailable(f"dockerd did not start: {tail[-600:]}")


def stop(engine: Engine, timeout: float = 30.0) -> None:
    """SIGTERM to our dockerd only (it stops its containers and its containerd), then remove its files."""
    if engine.popen.poll() is None:
        os.kill(engine.pid, signal.SIGTERM)
        try:
            engine.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(engine.pid, signal.SIGKILL)
            engine.popen.wait(10)
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    for mount in sorted((m.split()[1] for m in mounts if m.split()[1].startswith(str(engine.home))), reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
    shutil.rmtree(engine.home, ignore_errors=True)


PREPARE = "run ARM64=1 deploy/offline/prepare.sh first (it needs the Debian mirror and the package index)"


def base_tarball(arch: str = "amd64") -> Path:
    tarball = CACHE / ("base-bookworm.tar" if arch == "amd64" else f"base-bookworm-{arch}.tar")
    if not tarball.is_file():
        raise EngineUnavailable(f"no base image tarball at {tarball}: {PREPARE}")
    return tarball


def import_base_image(engine: Engine, arch: str = "amd64") -> None:
    """Load the debootstrap base image from the tarball deploy/offline/prepare.sh keeps in the cache, as an
    image archive labelled with its architecture (deploy/offline/image_archive.py; `docker import` would
    label an arm64 root file system amd64)."""
    tarball = base_tarball(arch)
    script = ROOT / "deploy" / "offline" / "image_archive.py"
    with subprocess.Popen(
        [sys.executable, str(script), str(tarball), base_image(arch), arch], stdout=subprocess.PIPE
    ) as archive:
        loaded = subprocess.run(
            [docker_cli(), "load"], stdin=archive.stdout, capture_output=True, env=engine.env, timeout=300, check=False
        )
    if archive.returncode != 0 or loaded.returncode != 0:
        raise RuntimeError(f"loading {tarball} as {base_image(arch)} failed: {loaded.stderr.decode()[-1000:]}")


def base_image(arch: str = "amd64") -> str:
    return BASE_IMAGE if arch == "amd64" else f"{BASE_IMAGE}-{arch}"


def node_image(arch: str = "amd64") -> str:
    """The lean node image (deploy/Dockerfile.node) for `arch`."""
    return "layerswarm:node" if arch == "amd64" else f"layerswarm:node-{arch}"


def node_wheelhouse(machine: str = "x86_64") -> Path:
    """The lean node's wheelhouse (no torch) for `machine` (x86_64, aarch64)."""
    path = ROOT / (".wheelhouse-node" if machine == "x86_64" else f".wheelhouse-node-{machine}")
    if not any(path.glob("numpy-*.whl")):
        raise EngineUnavailable(f"no lean node wheelhouse at {path}: {PREPARE}")
    return path


def why_no_arm64() -> str | None:
    """Why arm64 programs cannot run here, or None: qemu-aarch64 must be registered with binfmt_misc's
    F flag (deploy/offline/enable-arm64-emulation.sh), so containers need no copy of the interpreter."""
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    try:
        flags = next((line for line in entry.read_text().splitlines() if line.startswith("flags:")), "")
    except OSError:
        return "qemu-aarch64 is not registered with binfmt_misc (deploy/offline/enable-arm64-emulation.sh)"
    if "F" not in flags.split(":", 1)[1]:
        return "qemu-aarch64 is registered without the F flag (deploy/offline/enable-arm64-emulation.sh)"
    return None


def haproxy_debs() -> Path:
    """The HAProxy packages the load balancer image installs (deploy/offline/make-debs.sh)."""
    path = ROOT / ".debs-haproxy"
    if not any(path.glob("haproxy_*.deb")):
        raise EngineUnavailable(f"no HAProxy packages at {path}: {PREPARE}")
    return path


def wheelhouse() -> Path:
    path = ROOT / WHEELHOUSE
    if not any(path.glob("torch-*.whl")):
        raise EngineUnavailable(f"no wheelhouse at {path}: {PREPARE}")
    return path
