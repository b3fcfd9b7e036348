"""Link shaping for the emulated LAN (harness/netlab.py): `tc tbf` on both ends of a host's veth pair.

netem is missing on this kernel; tbf works. The host's eth0 (its egress: host -> LAN) and the
bridge-side veth (its egress: LAN -> host) get the same rate, so every transfer between two hosts,
or between the coordinator (on the bridge) and a host, crosses a shaper at that rate in each
direction. The shaping is checked with a raw TCP transfer (`measure_mbps`), not trusted.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from .netlab import Host, NetLab, NetLabError

SINK_PORT = 5201
SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
for _ in range(int(sys.argv[3])):
    conn, _ = srv.accept()
    with conn:
        want = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big")
        got = 0
        while got < want:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        conn.sendall(b"k")
"""


def _tc(args: list[str], host: Host | None = None) -> None:
    cmd = ["tc", *args] if host is None else host.command(["tc", *args])
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetLabError(f"{' '.join(cmd)}: {result.stderr.strip()}")


def tbf_args(device: str, mbit: float) -> list[str]:
    # A burst of ~1 ms at the rate (at least a few packets): small enough that one activation is not
    # sent at line speed before the bucket bites, large enough for the kernel timer.
    burst = max(int(mbit * 1e6 / 8 / 1000), 8 * 1514)
    return [
        "qdisc",
        "replace",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{mbit}mbit",
        "burst",
        str(burst),
        "latency",
        "200ms",
    ]


def shape(host: Host, mbit: float) -> None:
    """Both directions of `host`'s link at `mbit` Mbit/s."""
    _tc(tbf_args("eth0", mbit), host)
    _tc(tbf_args(host.veth, mbit))


def measure_mbps(host: Host, nbytes: int, reps: int = 3) -> float:
    """Raw TCP from this namespace (the bridge side) into `host`: the median achieved Mbit/s."""
    sink = subprocess.Popen(
        host.command([sys.executable, "-c", SINK, host.address, str(SINK_PORT), str(reps)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != "ready":
            raise NetLabError("TCP sink did not start")
        rates = []
        payload = b"\0" * nbytes
        for _ in range(reps):
            with socket.create_connection((host.address, SINK_PORT), timeout=60) as conn:
                started = time.perf_counter()
                conn.sendall(nbytes.to_bytes(8, "big") + payload)
                conn.recv(1)
                rates.append(nbytes * 8 / (time.perf_counter() - started) / 1e6)
        return sorted(rates)[len(rates) // 2]
    finally:
        sink.wait(10)


def slow_start_after_idle(on: bool, host: Host | None = None) -> None:
    """Linux restarts a TCP connection's window after it was idle (RFC 2861), so a link that carries
    one activation per request ramps up from 10 packets every time. The sysctl is per network
    namespace: this changes only `host`'s (None: the caller's, which must be a private one)."""
    cmd = ["sysctl", "-q", "-w", f"net.ipv4.tcp_slow_start_after_idle={int(on)}"]
    result = subprocess.run(cmd if host is None else host.command(cmd), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetLabError(f"{' '.join(cmd)}: {result.stderr.strip()}")


def shaped_hosts(lab: NetLab, count: int, prefix: str, mbit: float) -> list[Host]:
    """`count` new hosts on the lab's LAN, each link shaped to `mbit` both ways, TCP's slow start after
    idle off on both ends (a hop after a pause would otherwise restart from a small window). A lab on a
    delaying switch shapes there (the TAP devices have no veth end here for tbf)."""
    if lab.link is not None and lab.link.mbit != mbit:
        raise NetLabError(f"the lab's switch runs its links at {lab.link.mbit} Mbit/s, not {mbit}")
    hosts = [lab.add_host(f"{prefix}{i}") for i in range(count)]
    slow_start_after_idle(False)
    for host in hosts:
        if lab.link is None:
            shape(host, mbit)
        slow_start_after_idle(False, host)
    return hosts
