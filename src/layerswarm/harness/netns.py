"""Keep multicast off real networks: run mDNS work inside a private network namespace.

`layerswarm up` (and the test runner) re-execute themselves under `unshare --net`, where only a
loopback interface exists; multicast is routed to it so zeroconf works, and nothing reaches a LAN.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LOOPBACK_MULTICAST = "ip link set lo up; ip link set lo multicast on; ip route add 224.0.0.0/4 dev lo 2>/dev/null; true"


def interfaces() -> list[str]:
    """Interfaces of this process's network namespace (/proc/net/dev is per namespace; /sys is not)."""
    dev = Path("/proc/net/dev")
    if not dev.is_file():
        return []
    return sorted(line.split(":", 1)[0].strip() for line in dev.read_text().splitlines()[2:] if ":" in line)


LAB_PREFIXES = ("lsbr", "lsv")  # bridges and veths that layerswarm.harness.netlab makes in here


def in_private_netns() -> bool:
    """True when this namespace has loopback and, at most, the test LAN's own links: no real
    interface, so multicast cannot leave this machine."""
    names = interfaces()
    return "lo" in names and all(n == "lo" or n.startswith(LAB_PREFIXES) for n in names)


def loopback_multicast_ready() -> bool:
    out = subprocess.run(["ip", "-o", "link", "show", "lo"], capture_output=True, text=True, check=False).stdout
    return "MULTICAST" in out and ",UP" in out.replace("<", ",")


def can_unshare() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    flags = ["-n"] if os.geteuid() == 0 else ["-rn"]
    probe = subprocess.run(["unshare", *flags, "true"], capture_output=True, check=False)
    return probe.returncode == 0


def reexec_in_private_netns(argv: list[str]) -> int:
    """Run `python -m layerswarm ARGV` in a fresh network namespace with multicast on loopback."""
    flags = ["-n"] if os.geteuid() == 0 else ["-rn"]
    script = f'{LOOPBACK_MULTICAST}; exec "$@"'
    cmd = ["unshare", *flags, "sh", "-c", script, "sh", sys.executable, "-m", "layerswarm", *argv]
    env = {**os.environ, "LAYERSWARM_NETNS": "1"}
    return subprocess.run(cmd, env=env, check=False).returncode


def bench_in_private_netns(module: str, quick: bool, args: Sequence[str] = ()) -> dict[str, Any]:
    """Run `python -m MODULE --json FILE [--quick] [ARGS]` (a bench that builds its own LAN of namespaces)
    in a fresh network namespace, as root, and return its report; {"skipped": why} when it cannot run."""
    if os.geteuid() != 0:
        return {"skipped": "needs root (network namespaces, veth pairs, tc)"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up; exec "$@"', "sh", sys.executable, "-m", module]
        done = subprocess.run([*cmd, "--json", str(out), *(["--quick"] if quick else []), *args], check=False)
        if done.returncode != 0 or not out.is_file():
            return {"skipped": f"the run in a private network namespace failed (exit {done.returncode})"}
        report: dict[str, Any] = json.loads(out.read_text())
        return report
