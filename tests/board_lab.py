"""Boards for tests/deploy/test_home_lan.py: lab hosts (harness/netlab.py) that look like a fresh Raspberry Pi
OS board to the deploy tools. Each has its own network and mount namespaces; in the latter, its own
/home (the login `pi`, uid 4242, with an authorized key), /etc/passwd, /etc/group and /etc/shadow that
know `pi`, a private /run, and the distribution's OpenSSH server listening on its LAN address.

Two stand-ins, because systemd cannot run in a plain namespace and torch is not downloaded three times
in a test: the board's PATH starts with tests/home_lan_board/ (a `systemctl` that runs a user unit's
command line as systemd would, a no-op `loginctl`, and `python3`, the system Python of the same minor
version as this venv), and that Python's site folder holds one .pth naming this venv's site-packages:
the runtime's dependencies are "installed on the system", as a Jetson image's torch is, so the deploy
tools' install step runs with VENV_ARGS=--system-site-packages and PIP_ARGS="--no-index --no-deps".

Everything a board runs is in its namespaces: power_off() pulls its cable and kills exactly those
processes (by PID, found by their network namespace).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from layerswarm.harness.netlab import Host, NetLab

SHIMS = Path(__file__).with_name("home_lan_board")
UID = 4242
LOGIN = "pi"


def board_python() -> str | None:
    """A system Python of this venv's minor version that `pi` may run and that can make venvs."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if not (Path(candidate).is_file() and _world_readable(Path(candidate))):
            continue
        probe = subprocess.run([candidate, "-m", "ensurepip", "--version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return candidate
    return None


def system_site(python: str) -> Path | None:
    """The first existing site folder of `python` (where a board's .pth goes, by a bind mount)."""
    code = "import site; print('\\n'.join(site.getsitepackages()))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False).stdout
    return next((Path(p) for p in out.split() if Path(p).is_dir()), None)


def missing() -> str | None:
    """Why boards cannot be made here, or None."""
    reason = NetLab.available()
    if reason:
        return reason
    for tool in ("/usr/sbin/sshd", "ssh", "ssh-keygen", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (openssh-server and openssh-client from the distribution)"
    python = board_python()
    if python is None:
        return f"no system python{sys.version_info.major}.{sys.version_info.minor} with venv (python3-venv)"
    if system_site(python) is None:
        return f"{python} has no site folder to hold the board's dependencies"
    if not _world_readable(Path(sysconfig.get_paths()["purelib"])):
        return "this venv is not readable by other users (a board's login runs the nodes)"
    return None


def _world_readable(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [path, *path.parents] if p.is_dir()) and bool(
        os.stat(path).st_mode & 0o004
    )


@dataclass
class Board:
    host: Host
    root: Path  # on this machine: the board's disk (its /home is root/home)
    sshd: subprocess.Popen[bytes]

    @property
    def home(self) -> Path:
        return self.root / "home" / LOGIN

    def node_logs(self) -> str:
        state = self.home / ".local/state/systemctl-shim"
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(state.glob("*.log")))

    def processes(self) -> list[int]:
        """PIDs of every process in the board's network namespace but its holder: sshd, its sessions,
        the nodes its `systemctl` started."""
        ours = os.readlink(f"/proc/{self.host.pid}/ns/net")
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != self.host.pid:
                try:
                    if os.readlink(entry / "ns/net") == ours:
                        pids.append(int(entry.name))
                except OSError:
                    continue  # gone meanwhile
        return pids

    def power_off(self) -> None:
        """Unplug the board and cut its power: no goodbye, no TCP reset, its processes gone."""
        subprocess.run(["ip", "link", "del", self.host.veth], capture_output=True, check=False)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.sshd.wait(5)


def _run(host: Host, script: str) -> None:
    done = subprocess.run(host.command(["sh", "-ec", script]), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{host.name}: {script!r}: {done.stderr.strip()}")


def _fresh_disk(root: Path, public_key: str, python: str) -> None:
    """The board's files on this machine: home, the account files, the sshd config and host key."""
    home = root / "home" / LOGIN
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text(public_key)
    (root / "etc").mkdir()
    for name, line in (
        ("passwd", f"{LOGIN}:x:{UID}:{UID}:test board login:/home/{LOGIN}:/bin/bash"),
        ("group", f"{LOGIN}:x:{UID}:"),
        ("shadow", f"{LOGIN}:*:19000:0:99999:7:::"),
    ):
        (root / "etc" / name).write_text(Path(f"/etc/{name}").read_text() + line + "\n")
    (root / "etc" / "shadow").chmod(0o640)
    bin_dir = root / "home" / ".board-bin"  # under /home on the board: `pi` cannot reach this machine's tmp
    bin_dir.mkdir()
    for shim in SHIMS.iterdir():
        (bin_dir / shim.name).symlink_to(shim)
    (bin_dir / "python3").symlink_to(python)
    (root / "site").mkdir()
    (root / "site" / "layerswarm-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for path in [home, *home.rglob("*")]:
        os.chown(path, UID, UID, follow_symlinks=False)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key")], check=True, capture_output=True
    )


def _sshd_config(root: Path, address: str) -> Path:
    bin_dir = "/home/.board-bin"  # the board's own view of it
    config = root / "sshd_config"
    config.write_text(
        f"ListenAddress {address}\nPort 22\nHostKey {root / 'host_key'}\nPidFile none\nUsePAM no\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin no\n"
        f"StrictModes no\nSetEnv PATH={bin_dir}:/usr/local/bin:/usr/bin:/bin\nLogLevel ERROR\n"
    )
    return config


def add_board(lab: NetLab, name: str, root: Path, public_key: str) -> Board:
    python = board_python()
    assert python is not None
    site = system_site(python)
    host = lab.add_host(name, own_mounts=True)
    _fresh_disk(root, public_key, python)
    mounts = [
        "mount -t tmpfs -o mode=755 tmpfs /run",
        "mkdir -m 755 /run/sshd",
        f"mount --bind {root / 'home'} /home",
        *(f"mount --bind {root / 'etc' / n} /etc/{n}" for n in ("passwd", "group", "shadow")),
        f"mount --bind {root / 'site'} {site}",
    ]
    _run(host, " && ".join(mounts))
    config = _sshd_config(root, host.address)
    with (root / "sshd.log").open("wb") as log:  # its complaints (a port probe's closed connection) stay here
        sshd = subprocess.Popen(host.command(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]), stderr=log)
    board = Board(host, root, sshd)
    _wait_for_port(host, 22)
    return board


def _wait_for_port(host: Host, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    probe = f"exec 3<>/dev/tcp/{host.address}/{port}"
    while time.monotonic() < deadline:
        if subprocess.run(host.command(["bash", "-c", probe]), capture_output=True, check=False).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{host.name}: sshd does not listen on port {port}")


def client_key(tmp: Path) -> Path:
    """The laptop's ssh key (its public half, which the boards authorize)."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "id_ed25519")], check=True)
    return tmp / "id_ed25519.pub"


def client_config(tmp: Path) -> Path:
    """The laptop's ssh config: client_key's key, new host keys accepted once, no prompts."""
    config = tmp / "ssh_config"
    config.write_text(
        f"Host *\n  IdentityFile {tmp / 'id_ed25519'}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {tmp / 'known_hosts'}\n  StrictHostKeyChecking accept-new\n"
        "  BatchMode yes\n  ConnectTimeout 10\n  LogLevel ERROR\n"
    )
    return config


def stop_boards(boards: list[Board]) -> None:
    for board in boards:
        for pid in board.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if board.sshd.poll() is None:
            board.sshd.kill()
        board.sshd.wait(5)
