"""A learning Ethernet switch in user space whose links have a rate and a one-way delay.

    python -m layerswarm.harness.delayswitch --mbit 100 --delay-ms 1

Why it exists: this kernel has tc tbf and htb but no netem (nor fq, cake or any qdisc that delays), so
the emulated LAN (harness/netlab.py) had rate limits but no latency, and a round trip there cost about
what it costs on loopback. Here every port is a TAP device this process holds; the lab moves each into
a host's network namespace as its eth0 (the fd keeps working across namespaces). A frame from port A to
port B leaves A's uplink at the link rate, arrives `delay` later, and is written into B after B's
downlink carried it at the same rate: each direction of each host link is a serializing link, as on a
switched LAN with a propagation delay. Broadcast, multicast (mDNS) and unknown destinations flood.

Ports are added at run time over stdin: a line `add NAME` makes TAP NAME and answers `ok NAME` (or
`error ...`); the switch runs until stdin closes or it is killed. Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import os
import selectors
import struct
import sys
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
FRAME_MAX = 65536
OVERHEAD_BYTES = 24  # preamble, frame check and inter-frame gap: what a wire carries beside the frame


def open_tap(name: str) -> int:
    """A new TAP device `name`, its fd non-blocking (frames in and out without a packet-info header)."""
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

    def _read(self, port: Port) -> None:
        for _ in range(64):  # a burst at a time, then let the timers run
            try:
                frame = os.read(port.fd, FRAME_MAX)
            except BlockingIOError:
                return
            except OSError as exc:  # the namespace holding the device is gone: stop reading it
                log.info("port %s closed: %s", port.name, exc)
                self.loop.remove_reader(port.fd)
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
        line = raw.decode().split()
        if not line:
            continue
        if line[0] == "add" and len(line) == 2:
            try:
                switch.add(line[1])
                print(f"ok {line[1]}", flush=True)
            except OSError as exc:
                print(f"error {line[1]}: {exc}", flush=True)
        else:
            print(f"error unknown command {' '.join(line)!r}", flush=True)


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
