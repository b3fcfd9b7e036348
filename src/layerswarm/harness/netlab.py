"""A small LAN on one machine: one network namespace per host, joined by a bridge.

Used by the multi-host tests (and failure injection): every node is its own host with its own address,
discovering the others over mDNS as on a real LAN, while nothing leaves this machine. It must run
inside a private network namespace (the bridge is created in the caller's namespace) and as root.

Host namespaces are held by a `sleep` process made with `unshare --net`; commands enter them with
`nsenter`, so no global state (/run/netns) is left behind if the test dies.

The LAN is a kernel bridge joined by veth pairs, or, given a `Link` (a rate and a one-way delay), a
user-space switch joined by TAP devices (harness/delayswitch.py): the kernel here has no netem, so a
LAN whose round trips cost what a real one's do needs the switch.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from layerswarm.harness.delayswitch import Link, SwitchProcess
from layerswarm.harness.netns import in_private_netns

log = logging.getLogger(__name__)
SUBNET = "198.18.0"  # RFC 2544's benchmarking range: never a real peer


class NetLabError(RuntimeError):
    pass


def _ip(*args: str, netns_pid: int | None = None) -> None:
    cmd = ["ip", *args] if netns_pid is None else ["nsenter", "-t", str(netns_pid), "-n", "ip", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetLabError(f"{' '.join(cmd)}: {result.stderr.strip()}")


def _wait_for_own_netns(pid: int, timeout: float = 5.0) -> None:
    ours = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != ours:
                return
        except FileNotFoundError as exc:
            raise NetLabError(f"namespace holder {pid} exited") from exc
        time.sleep(0.005)
    raise NetLabError(f"namespace holder {pid} did not enter its own network namespace")


@dataclass
class Host:
    name: str
    address: str
    holder: subprocess.Popen[bytes]
    veth: str  # the LAN side of its link: a veth on the bridge, or the name of its switch port
    own_mounts: bool = False  # a mount namespace of its own too (its own disk: see NetLab.add_host)

    @property
    def pid(self) -> int:
        return self.holder.pid

    def command(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` run inside this host's network namespace (and mount namespace, if it has one)."""
        return ["nsenter", "-t", str(self.pid), "-n", *(["-m"] if self.own_mounts else []), *cmd]

    def link(self, up: bool) -> None:
        """Pull or plug the host's cable (its eth0: a veth's end, or a TAP of the switch's)."""
        _ip("link", "set", "eth0", "up" if up else "down", netns_pid=self.pid)


@dataclass
class NetLab:
    bridge: str = "lsbr0"
    hosts: list[Host] = field(default_factory=list)
    gateway: str = f"{SUBNET}.1"
    link: Link | None = None  # a switch with this rate and delay instead of a bridge
    switch: SwitchProcess | None = None

    @staticmethod
    def available() -> str | None:
        """None when a lab can be built here, else why not."""
        if os.geteuid() != 0:
            return "needs root (veth pairs and bridges)"
        if not in_private_netns():
            return "must run inside a private network namespace (see scripts/test)"
        return None

    def start(self) -> NetLab:
        reason = self.available()
        if reason:
            raise NetLabError(reason)
        try:
            if self.link is None:
                _ip("link", "add", self.bridge, "type", "bridge")
            else:
                self.switch = SwitchProcess(self.link)
                self._switch_port(self.bridge)  # this namespace's own port: the coordinator's side of the LAN
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            _ip("route", "replace", "224.0.0.0/4", "dev", self.bridge)  # mDNS goes over the LAN, not loopback
        except NetLabError:
            self.stop()
            raise
        return self

    def _switch_port(self, name: str) -> None:
        assert self.switch is not None
        answer = self.switch.ask(f"add {name}")
        if answer != f"ok {name}":
            raise NetLabError(f"switch port {name}: {answer or 'the switch exited or did not answer'}")

    def _plug(self, veth: str, pid: int) -> None:
        """The host's end of its link into its namespace as eth0, the other end on the LAN."""
        if self.link is None:
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(pid))
            _ip("link", "set", veth, "master", self.bridge, "up")
        else:  # the switch holds the TAP's fd, which keeps working in the host's namespace
            self._switch_port(veth)
            _ip("link", "set", veth, "netns", str(pid))
            _ip("link", "set", veth, "name", "eth0", netns_pid=pid)

    def add_host(self, name: str, own_mounts: bool = False, links_first: Sequence[tuple[str, str]] = ()) -> Host:
        """A host on the LAN at the next address. `own_mounts`: a private mount namespace too, so that
        bind mounts made in it (a home folder, /etc/passwd) are this host's alone, like its own disk.
        `links_first`: (name, CIDR) bridges made before its LAN interface, as a host's docker0 or VPN
        comes before eth0 in its interface list; nothing is attached to them."""
        index = len(self.hosts) + 10
        mounts = ["--mount", "--propagation", "private"] if own_mounts else []
        holder = subprocess.Popen(["unshare", "--net", *mounts, "sleep", "86400"])
        # The switch's ports take names of their own: a bridge lab's veth of the same index can outlive
        # its lab briefly (a namespace is torn down in the background), and a TAP cannot take its name.
        veth = f"{'lsv' if self.link is None else 'lsw'}{index}"
        try:
            _wait_for_own_netns(holder.pid)  # else the veth's far end lands in *our* namespace
            for link, cidr in links_first:
                _ip("link", "add", link, "type", "bridge", netns_pid=holder.pid)
                _ip("addr", "add", cidr, "dev", link, netns_pid=holder.pid)
                _ip("link", "set", link, "up", netns_pid=holder.pid)
            self._plug(veth, holder.pid)
            address = f"{SUBNET}.{index}"
            for args in (
                ("link", "set", "lo", "up"),
                ("addr", "add", f"{address}/24", "dev", "eth0"),
                ("link", "set", "eth0", "up"),
                ("route", "add", "224.0.0.0/4", "dev", "eth0"),
            ):
                _ip(*args, netns_pid=holder.pid)
        except NetLabError:
            holder.kill()
            holder.wait(5)
            if self.switch is not None:
                self.switch.ask(f"del {veth}")  # "error ...: no such port" when it never made it
            else:
                subprocess.run(["ip", "link", "del", veth], capture_output=True, check=False)
            raise
        host = Host(name, address, holder, veth, own_mounts)
        self.hosts.append(host)
        return host

    def stop(self) -> None:
        for host in self.hosts:
            if self.link is None:  # at once: a namespace's own teardown runs in the background, later
                subprocess.run(["ip", "link", "del", host.veth], capture_output=True, check=False)
            host.holder.kill()
            host.holder.wait(5)
        self.hosts.clear()
        if self.switch is not None:  # its TAP devices go with it
            self.switch.stop()
            self.switch = None
        else:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def __enter__(self) -> NetLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
