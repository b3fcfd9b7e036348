"""A chaos swarm: the shipped family's nodes and one coordinator or several (active-active, each told of
the others with --coordinator-peer), each its own host (network namespace) on a bridge, discovering each
other over mDNS; and the faults that can be done to them."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from layerswarm.harness.netlab import Host, NetLab
from layerswarm.harness.procs import Proc, launch, layerswarm_cmd, node_cmd, stop_all, wait_for_ready_line

NODE_PORT = 50051
HTTP_PORT = 8080
FAULT_KINDS = ("kill", "freeze", "link", "drop", "netem", "slow", "malformed", "restart", "join", "coordinator")


@dataclass
class ChaosNode:
    name: str
    host: Host
    model_dir: Path
    block: int
    faults: tuple[str, ...] = ()  # --fault-* arguments: run under harness/faults.py, not `layerswarm node`
    proc: Proc | None = None
    token_file: Path | None = None  # the swarm token (calls signed with MACs derived from it)

    @property
    def address(self) -> str:
        return f"{self.host.address}:{NODE_PORT}"

    def command(self) -> list[str]:
        # A lab host's address is not loopback: without the token the node must be told --insecure.
        extra = (
            ("--grace", "0.5", "--insecure")
            if self.token_file is None
            else ("--grace", "0.5", "--token-file", str(self.token_file))
        )
        cmd = node_cmd(self.model_dir, self.block, *extra, host=self.host.address, port=NODE_PORT)
        if self.faults:  # the same node, built by the test-only fault wrapper
            cmd = [sys.executable, "-m", "layerswarm.harness.faults", *cmd[4:], *self.faults]
        return self.host.command(cmd)


@dataclass
class PeerCoordinator:
    """A coordinator besides the first (`ChaosSwarm.coordinator`): its host, arguments and process."""

    name: str
    host: Host
    args: list[str]
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{HTTP_PORT}"


@dataclass
class ChaosSwarm:
    lab: NetLab
    coordinator_host: Host
    coordinator_args: list[str]
    nodes: list[ChaosNode] = field(default_factory=list)
    coordinator: Proc | None = None
    others: list[PeerCoordinator] = field(default_factory=list)  # coordinators 2..N (--coordinators)
    token: str | None = None
    token_file: Path | None = None
    state_dir: Path | None = None  # the run's own peer memory: never the user's default state file
    last_restart: dict[str, float] = field(default_factory=dict)  # the last coordinator restart's timings

    @property
    def url(self) -> str:
        return f"http://{self.coordinator_host.address}:{HTTP_PORT}"

    @property
    def urls(self) -> list[str]:
        """Every coordinator's URL, the first one's first."""
        return [self.url, *(c.url for c in self.others)]

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start_nodes(self, nodes: list[ChaosNode], timeout: float = 240.0) -> None:
        # 240 s: sixteen nodes import torch at once, and on a shared 2-core machine at load 20-28 the
        # first was not ready after 120 s (twice, 2026-11-28).
        for node in nodes:
            node.proc = launch(node.name, node.command())
        for node in nodes:
            assert node.proc is not None
            wait_for_ready_line(node.proc, timeout)

    def start_coordinator(self, timeout: float = 60.0) -> None:
        argv = self.coordinator_host.command(layerswarm_cmd(*self.coordinator_args))
        self.coordinator = wait_for_ready_line(launch("coordinator", argv), timeout)

    def start_coordinators(self, timeout: float = 90.0) -> None:
        """The first coordinator and the others, started together (their imports overlap)."""
        first = launch("coordinator", self.coordinator_host.command(layerswarm_cmd(*self.coordinator_args)))
        for other in self.others:
            other.proc = launch(other.name, other.host.command(layerswarm_cmd(*other.args)))
        self.coordinator = wait_for_ready_line(first, timeout)
        for other in self.others:
            assert other.proc is not None
            wait_for_ready_line(other.proc, timeout)

    def coordinator_proc(self, index: int) -> Proc | None:
        return self.coordinator if index == 0 else self.others[index - 1].proc

    def kill_coordinator(self, index: int) -> None:
        """SIGKILL coordinator `index` (0: the first): no shutdown, in-flight requests cut."""
        proc = self.coordinator_proc(index)
        assert proc is not None
        proc.signal(signal.SIGKILL)
        proc.popen.wait(5)

    def start_coordinator_at(self, index: int, timeout: float = 90.0) -> Proc:
        """Start coordinator `index` again, on its host, port and arguments; returns once it serves."""
        if index == 0:
            self.start_coordinator(timeout)
            assert self.coordinator is not None
            return self.coordinator
        other = self.others[index - 1]
        other.proc = wait_for_ready_line(launch(other.name, other.host.command(layerswarm_cmd(*other.args))), timeout)
        return other.proc

    def stop(self) -> None:
        procs = [n.proc for n in self.nodes if n.proc is not None]
        stop_all([p for p in [self.coordinator, *(c.proc for c in self.others), *procs] if p is not None])
        self.lab.stop()
        if self.token_file is not None:
            self.token_file.unlink(missing_ok=True)
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def add_node(self, node: ChaosNode) -> ChaosNode:
        node.token_file = self.token_file
        self.nodes.append(node)
        return node

    # --- faults ------------------------------------------------------------------------------------------

    def kill(self, node: ChaosNode) -> None:
        assert node.proc is not None
        node.proc.signal(signal.SIGKILL)
        node.proc.popen.wait(5)

    def restart(self, node: ChaosNode, faults: tuple[str, ...] = ()) -> None:
        """Start the node again on the same host and port (a reboot, or a redeploy with a fault:
        `faults` are harness/faults.py arguments, e.g. ("--fault-mode", "zeros"))."""
        if node.proc is not None and node.proc.alive:
            node.proc.stop(5)
        node.faults = faults
        self.start_nodes([node])

    def freeze(self, node: ChaosNode, frozen: bool) -> None:
        assert node.proc is not None
        node.proc.signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def drop_packets(self, node: ChaosNode, drop: bool) -> None:
        """nftables inside the node's namespace: silently drop everything to its gRPC port."""
        if drop:
            script = (
                f"add table inet chaos\nadd chain inet chaos input {{ type filter hook input priority 0; }}\n"
                f"add rule inet chaos input tcp dport {NODE_PORT} drop\n"
            )
        else:
            script = "delete table inet chaos\n"
        subprocess.run(node.host.command(["nft", "-f", "-"]), input=script, text=True, check=True, capture_output=True)

    def netem(self, node: ChaosNode, delay_ms: int | None) -> None:
        action = (
            ["replace", "dev", "eth0", "root", "netem", "delay", f"{delay_ms}ms"]
            if delay_ms
            else ["del", "dev", "eth0", "root"]
        )
        subprocess.run(node.host.command(["tc", "qdisc", *action]), check=True, capture_output=True)

    def restart_coordinator(self) -> dict[str, float]:
        """Stop and start the coordinator; returns how long each took (the outage clients see)."""
        assert self.coordinator is not None
        started = time.monotonic()
        self.coordinator.stop(10)
        stopped = time.monotonic()
        self.start_coordinator()
        return {"stop_s": round(stopped - started, 3), "start_to_ready_s": round(time.monotonic() - stopped, 3)}


def fault_tools() -> dict[str, bool]:
    """Which faults this machine can do: nftables and netem are probed, never assumed."""
    nft = shutil.which("nft") is not None
    netem = False
    if shutil.which("tc") and shutil.which("unshare"):
        probe = subprocess.run(
            ["unshare", "-n", "sh", "-c", "ip link set lo up && tc qdisc add dev lo root netem delay 1ms"],
            capture_output=True,
            check=False,
        )
        netem = probe.returncode == 0
    return {"nftables": nft, "netem": netem}


def build(
    members: list[Path],
    depth: int,
    extra_coordinator: tuple[str, ...] = (),
    token: bool = False,
    coordinators: int = 1,
) -> ChaosSwarm:
    """Hosts for every block of every member and one for each coordinator (not started yet). With `token`,
    every process gets the same fresh swarm token (a file only this process's user can read). Several
    `coordinators` (a token is needed: tips are signed with it) each get the others as --coordinator-peer
    and a peer memory of their own."""
    if coordinators > 1 and not token:
        raise ValueError("several coordinators need a swarm token: the tips between them are signed with it")
    lab = NetLab().start()
    token_file = None
    # The run's own peer memory, token or not: the default file (by port: 8080) is the user's, and the
    # lab addresses left in it would be dialled by their next coordinator on that port, out of a real
    # interface.
    state_dir = Path(tempfile.mkdtemp(prefix="layerswarm-chaos-"))
    try:
        if token:
            handle, name = tempfile.mkstemp(prefix="layerswarm-chaos-token-")
            os.write(handle, secrets.token_hex(16).encode())
            os.close(handle)
            token_file = Path(name)
            extra_coordinator = (*extra_coordinator, "--token-file", str(token_file))
        else:  # the lab's bridge address is not loopback: an open swarm must say so
            extra_coordinator = (*extra_coordinator, "--insecure")
        hosts = [lab.add_host("coordinator" if i == 0 else f"coordinator-{i + 1}") for i in range(coordinators)]
        urls = [f"http://{h.address}:{HTTP_PORT}" for h in hosts]

        def args(i: int) -> list[str]:
            peers = [f"--coordinator-peer={u}" for j, u in enumerate(urls) if j != i]
            state = state_dir / ("peers.json" if i == 0 else f"peers-{i + 1}.json")
            return [
                "coordinator",
                "--model-dir",
                str(members[0]),
                "--http-host",
                hosts[i].address,
                "--http-port",
                str(HTTP_PORT),
                "--health-interval",
                "0.25",
                "--hop-timeout",
                "0.5",
                "--request-timeout",
                "5",
                *[f"--family-dir={m}" for m in members[1:]],
                *extra_coordinator,
                "--state-file",
                str(state),
                *peers,
            ]

        swarm = ChaosSwarm(lab, hosts[0], args(0), token_file=token_file, state_dir=state_dir)
        swarm.others = [PeerCoordinator(f"coordinator-{i + 1}", hosts[i], args(i)) for i in range(1, coordinators)]
        if token_file is not None:
            swarm.token = token_file.read_text()
        for m, model_dir in enumerate(members):
            for block in range(depth):
                name = f"node-b{block}-m{m}"
                swarm.add_node(ChaosNode(name, lab.add_host(name), model_dir, block))
    except Exception:
        lab.stop()
        if token_file is not None:
            token_file.unlink(missing_ok=True)
        shutil.rmtree(state_dir, ignore_errors=True)
        raise
    return swarm
