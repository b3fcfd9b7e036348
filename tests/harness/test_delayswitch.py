"""The delaying switch (harness/delayswitch.py) gives a LAN of namespaces the latency and rate it is told
to, and carries what a LAN carries (multicast for mDNS, a pulled cable's loss): the speculation bench's
LAN figures rest on it."""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Iterator

import pytest

from layerswarm.harness.delayswitch import Link, SwitchProcess
from layerswarm.harness.netlab import Host, NetLab, NetLabError
from layerswarm.harness.shaping import measure_mbps, shaped_hosts

ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 6000))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(2048)
    s.sendto(data, peer)
"""
PING = """
import socket, statistics, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
times = []
for _ in range(int(sys.argv[2])):
    started = time.perf_counter()
    s.sendto(b"x" * 200, (sys.argv[1], 6000))
    try:
        s.recv(2048)
    except TimeoutError:
        continue
    times.append(time.perf_counter() - started)
print(len(times), statistics.median(times) if times else -1)
"""
MDNS = "('224.0.0.251', 5353)"
LISTEN = f"""
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind({MDNS})
group = struct.pack("4s4s", socket.inet_aton("224.0.0.251"), socket.inet_aton("0.0.0.0"))
s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, group)
s.settimeout(10)
print(s.recv(100).decode(), flush=True)
"""
SEND = f"""
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(20):
    s.sendto(b"hello", {MDNS})
    time.sleep(0.1)
"""


def _needs_lab() -> None:
    reason = NetLab.available()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def echo_of() -> Iterator[dict[str, subprocess.Popen[str]]]:
    started: dict[str, subprocess.Popen[str]] = {}
    yield started
    for proc in started.values():
        proc.kill()
        proc.wait(5)


def _echo(host: Host, echo_of: dict[str, subprocess.Popen[str]]) -> None:
    proc = subprocess.Popen(host.command([sys.executable, "-c", ECHO, host.address]), stdout=subprocess.PIPE, text=True)
    echo_of[host.name] = proc
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"


def _ping(src: Host, dst: Host, count: int = 30) -> tuple[int, float]:
    """(answers, median round trip in seconds) of `count` UDP pings from `src` to `dst`'s echo."""
    done = subprocess.run(
        src.command([sys.executable, "-c", PING, dst.address, str(count)]),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    answers, median = done.stdout.split()
    return int(answers), float(median)


def _round_trip(link: Link | None, echo_of: dict[str, subprocess.Popen[str]]) -> float:
    with NetLab(link=link) as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        _echo(b, echo_of)
        answers, median = _ping(a, b)
        echo_of.pop("b").kill()
    assert answers == 30
    return median


def test_a_round_trip_between_hosts_costs_twice_the_delay_more_than_on_the_bridge(
    echo_of: dict[str, subprocess.Popen[str]],
) -> None:
    _needs_lab()
    bridge = _round_trip(None, echo_of)
    delayed = _round_trip(Link(100, 0.002), echo_of)
    # 4 ms of delay in all (2 ms each way); a switch that forgot the delay, or slept a tick too long
    # (epoll's millisecond timeouts would round each 2 ms wait up), falls outside.
    extra = delayed - bridge
    assert 0.0038 <= extra < 0.0055, (bridge, delayed)


def test_a_host_link_carries_the_switchs_rate_not_more() -> None:
    _needs_lab()
    with NetLab(link=Link(20, 0.0005)) as lab:
        host = lab.add_host("a")
        rate = statistics.median(measure_mbps(host, 2_000_000, reps=1) for _ in range(3))
    assert 14 < rate <= 20.5, rate  # TCP and Ethernet headers take a few percent of the 20 Mbit/s


def test_multicast_reaches_every_host_and_a_pulled_cable_loses_frames_until_plugged(
    echo_of: dict[str, subprocess.Popen[str]],
) -> None:
    _needs_lab()
    with NetLab(link=Link(100, 0.0005)) as lab:
        a, b, c = (lab.add_host(n) for n in "abc")
        listeners = [
            subprocess.Popen(h.command([sys.executable, "-c", LISTEN]), stdout=subprocess.PIPE, text=True)
            for h in (b, c)
        ]
        try:
            subprocess.run(a.command([sys.executable, "-c", SEND]), check=True, timeout=30)
            heard = [p.communicate(timeout=15)[0].strip() for p in listeners]
        finally:
            for p in listeners:
                p.kill()
                p.wait(5)
        assert heard == ["hello", "hello"]
        _echo(b, echo_of)
        b.link(False)
        assert _ping(a, b, count=3)[0] == 0
        b.link(True)
        assert _ping(a, b, count=10)[0] >= 9  # the first may wait on the neighbour cache


def test_the_control_pipe_answers_every_command_and_a_blank_line_changes_nothing() -> None:
    _needs_lab()
    switch = SwitchProcess(Link(100, 0.001))
    try:
        assert switch.ask("add lsx1") == "ok lsx1"
        assert switch.ask("add lsx1").startswith("error lsx1")  # the name is taken
        assert switch.ask("add " + "x" * 16).startswith("error")  # longer than an interface name may be
        assert switch.ask("frobnicate lsx1").startswith("error unknown command")
        assert switch.proc.stdin is not None
        switch.proc.stdin.write("\n")
        assert switch.ask("add lsx2") == "ok lsx2"  # the blank line did not shut the switch down
        assert switch.ask("del lsx1") == "ok lsx1"
        assert subprocess.run(["ip", "link", "show", "lsx1"], capture_output=True, check=False).returncode != 0
        assert switch.ask("del lsx1") == "error lsx1: no such port"
    finally:
        switch.stop()
    assert switch.proc.returncode == 0  # it left on its stdin's end, not killed
    assert subprocess.run(["ip", "link", "show", "lsx2"], capture_output=True, check=False).returncode != 0


def test_a_lab_on_a_switch_refuses_hosts_shaped_to_another_rate() -> None:
    _needs_lab()
    with NetLab(link=Link(20, 0.001)) as lab, pytest.raises(NetLabError, match="20"):
        shaped_hosts(lab, 1, "h", 100)


def test_the_switch_names_the_flag_it_refuses() -> None:
    cmd = [sys.executable, "-m", "layerswarm.harness.delayswitch", "--delay-ms", "-1"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--delay-ms" in done.stderr and "Traceback" not in done.stderr
