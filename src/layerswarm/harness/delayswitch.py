"""A learning Ethernet switch in user space whose links have a rate and a one-way delay.

    python -m layerswarm.harness.delayswitch --mbit 100 --delay-ms 1

Why it exists: this kernel has tc tbf and htb but no netem (nor fq, cake or any qdisc that delays), so
the emulated LAN (harness/netlab.py) had rate limits but no latency, and a round trip there cost about
what it costs on loopback. Here every port is a TAP device this process holds; the lab moves each into
a host's network namespace as its eth0 (the fd keeps working across namespaces). A frame from port A to
port B leaves A's uplink at the link rate, arrives `delay` later, and is written into B after B's
downlink carried it at the same rate: each direction of each host link is a serializing link with a
propagation delay, and a port's queue holds QUEUE_FRAMES frames before it drops (drop-tail). Broadcast,
multicast (mDNS) and unknown destinations flood. The switch is a Python process: on the machine it
emulates a LAN for, it spends CPU on every frame and adds its own wake-up to every delivery.

Ports are added at run time over stdin (`SwitchProcess` drives it): a line `add NAME` makes TAP NAME,
`del NAME` removes it, each answered `ok NAME` or `error ...`; the switch runs until stdin closes or it
is killed. Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import select
import selectors
import struct
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
FRAME_MAX = 65536
QUEUE_FRAMES = 1000  # a port's queue, as a Linux interface's default txqueuelen: beyond it frames drop
NAME_MAX = 15  # IFNAMSIZ less its terminating NUL
OVERHEAD_BYTES = 24  # preamble, frame check and inter-frame gap: what a wire carries beside the frame


def open_tap(name: str) -> int:
    """A new TAP device `name`, its fd non-blocking (frames in and out without a packet-info header)."""
    if not 0 < len(name.encode()) <= NAME_MAX:
        raise OSError(f"an interface name takes 1 to {NAME_MAX} bytes, not {name!r}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class Port:
    name: str
    fd: int
    up_free: float = 0.0  # when this host's uplink is free again (the loop's clock, seconds)
    down_free: float = 0.0  # when the switch's link down to this host is free again
    queue: deque[tuple[float, bytes]] = field(default_factory=deque)  # (due, frame), due non-decreasing
    timer: asyncio.TimerHandle | None = None


@dataclass
class Link:
    """Both directions of every host link: `mbit` Mbit/s each, `delay_s` one way from host to host."""

    mbit: float
    delay_s: float

    def wire_s(self, nbytes: int) -> float:
        return (nbytes + OVERHEAD_BYTES) * 8 / (self.mbit * 1e6)


class Switch:
    def __init__(self, link: Link, loop: asyncio.AbstractEventLoop) -> None:
        self.link = link
        self.loop = loop
        self.ports: list[Port] = []
        self.where: dict[bytes, Port] = {}  # source MAC -> the port it was last seen on

    def add(self, name: str) -> Port:
        port = Port(name, open_tap(name))
        self.ports.append(port)
        self.loop.add_reader(port.fd, self._read, port)
        return port

    def drop(self, name: str) -> bool:
        """Unplug port `name`: its TAP device goes with its fd. False when there is no such port."""
        port = next((p for p in self.ports if p.name == name), None)
        if port is None:
            return False
        self._unplug(port)
        return True

    def _unplug(self, port: Port) -> None:
        self.loop.remove_reader(port.fd)
        if port.timer is not None:
            port.timer.cancel()
        os.close(port.fd)
        self.ports.remove(port)
        self.where = {mac: p for mac, p in self.where.items() if p is not port}

    def _read(self, port: Port) -> None:
        for _ in range(64):  # a burst at a time, then let the timers run
            try:
                frame = os.read(port.fd, FRAME_MAX)
            except BlockingIOError:
                return
            except OSError as exc:  # the namespace holding the device is gone: the port with it
                log.info("port %s closed: %s", port.name, exc)
                self._unplug(port)
                return
            self._carry(port, frame, self.loop.time())

    def _carry(self, src: Port, frame: bytes, now: float) -> None:
        if len(frame) < 14:
            return
        self.where[frame[6:12]] = src
        wire = self.link.wire_s(len(frame))
        src.up_free = max(now, src.up_free) + wire
        arrives = src.up_free + self.link.delay_s
        dst = self.where.get(frame[0:6]) if not frame[0] & 1 else None  # group bit: broadcast, multicast
        for port in [dst] if dst is not None else self.ports:
            if port is not src:
                port.down_free = max(arrives, port.down_free) + wire
                self._enqueue(port, port.down_free, frame)

    def _enqueue(self, port: Port, due: float, frame: bytes) -> None:
        if len(port.queue) >= QUEUE_FRAMES:  # a full queue drops the newest frame, as a switch's buffer does
            log.debug("queue for %s full: a frame dropped", port.name)
            port.down_free -= self.link.wire_s(len(frame))  # it never takes the link
            return
        port.queue.append((due, frame))
        if port.timer is None:
            port.timer = self.loop.call_at(due, self._deliver, port)

    def _deliver(self, port: Port) -> None:
        port.timer = None
        now = self.loop.time()
        while port.queue and port.queue[0][0] <= now + 50e-6:  # frames due within the timer's slack go too
            _, frame = port.queue.popleft()
            try:
                os.write(port.fd, frame)
            except OSError as exc:  # the host's interface is down (a pulled cable): the frame is lost
                log.debug("frame for %s lost: %s", port.name, exc)
        if port.queue:
            port.timer = self.loop.call_at(port.queue[0][0], self._deliver, port)


async def serve(link: Link) -> None:
    loop = asyncio.get_running_loop()
    switch = Switch(link, loop)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while raw := await reader.readline():  # until stdin closes: the lab is done
        line = raw.decode(errors="replace").split()
        if line:
            print(_command(switch, line), flush=True)


def _command(switch: Switch, line: list[str]) -> str:
    """`add NAME` or `del NAME`; the answer is `ok NAME` or `error ...`."""
    if len(line) == 2 and line[0] == "add":
        try:
            switch.add(line[1])
        except OSError as exc:
            return f"error {line[1]}: {exc}"
        return f"ok {line[1]}"
    if len(line) == 2 and line[0] == "del":
        return f"ok {line[1]}" if switch.drop(line[1]) else f"error {line[1]}: no such port"
    return f"error unknown command {' '.join(line)!r}: add NAME or del NAME"


class SwitchProcess:
    """This module run as a child process, and its ports added and removed over its stdin."""

    def __init__(self, link: Link) -> None:
        cmd = [sys.executable, "-m", "layerswarm.harness.delayswitch", "--mbit", str(link.mbit)]
        cmd += ["--delay-ms", str(link.delay_s * 1000)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, command: str, timeout: float = 10.0) -> str:
        """Send one command, return the switch's answer ("" when it exited or took over `timeout`)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except OSError:  # the switch is gone
            return ""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().strip() if ready else ""

    def stop(self) -> None:
        """Close its stdin (it exits, its TAP devices with it); kill it if it does not within 5 s."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with contextlib.suppress(OSError):  # a switch that died leaves a broken pipe: nothing to tell it
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbit", type=float, default=100.0, help="rate of each direction of each host link")
    parser.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay from host to host")
    args = parser.parse_args(argv)
    if args.mbit <= 0 or args.delay_ms < 0:
        parser.error("--mbit must be above 0 and --delay-ms at least 0")
    logging.basicConfig(level=logging.WARNING)
    # select(2) takes microseconds where epoll takes milliseconds: with epoll every delay would come
    # out up to a millisecond long.
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        loop.run_until_complete(serve(Link(args.mbit, args.delay_ms / 1000)))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
