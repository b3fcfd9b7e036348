"""A chaos swarm: the shipped family's nodes and a coordinator, each its own host (network namespace)
on a bridge, discovering each other over mDNS; and the faults that can be done to them."""

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
class ChaosSwarm:
    lab: NetLab
    coordinator_host: Host
    coordinator_args: list[str]
    nodes: list[ChaosNode] = field(default_factory=list)
    coordinator: Proc | None = None
    token: str | None = None
    token_file: Path | None = None
    state_dir: Path | None = None  # the run's own peer memory: never the user's default state file
    last_restart: dict[str, float] = field(default_factory=dict)  # the last coordinator restart's timings

    @property
    def url(self) -> str:
        return f"http://{self.coordinator_host.address}:{HTTP_PORT}"

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start_nodes(self, nodes: list[ChaosNode], timeout: float = 120.0) -> None:
        for node in nodes:
            node.proc = launch(node.name, node.command())
        for node in nodes:
            assert node.proc is not None
            wait_for_ready_line(node.proc, timeout)

    def start_coordinator(self, timeout: float = 60.0) -> None:
        argv = self.coordinator_host.command(layerswarm_cmd(*self.coordinator_args))
        self.coordinator = wait_for_ready_line(launch("coordinator", argv), timeout)

    def stop(self) -> None:
        procs = [n.proc for n in self.nodes if n.proc is not None]
        stop_all([p for p in [self.coordinator, *procs] if p is not None])
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


def build(members: list[Path], depth: int, extra_coordinator: tuple[str, ...] = (), token: bool = False) -> ChaosSwarm:
    """Hosts for every block of every member and one for the coordinator (not started yet). With `token`,
    every process gets the same fresh swarm token (a file only this process's user can read)."""
    lab = NetLab().start()
    token_file = None
    # The run's own peer memory, token or not: the default file (by port: 8080) is the user's, and the
    # lab addresses left in it would be dialled by their next coordinator on that port, out of a real
    # interface.
    state_dir = Path(tempfile.mkdtemp(prefix="layerswarm-chaos-"))
    extra_coordinator = (*extra_coordinator, "--state-file", str(state_dir / "peers.json"))
    try:
        if token:
            handle, name = tempfile.mkstemp(prefix="layerswarm-chaos-token-")
            os.write(handle, secrets.token_hex(16).encode())
            os.close(handle)
            token_file = Path(name)
            extra_coordinator = (*extra_coordinator, "--token-file", str(token_file))
        else:  # the lab's bridge address is not loopback: an open swarm must say so
            extra_coordinator = (*extra_coordinator, "--insecure")
        coordinator_host = lab.add_host("coordinator")
        args = [
            "coordinator",
            "--model-dir",
            str(members[0]),
            "--http-host",
            coordinator_host.address,
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
        ]
        swarm = ChaosSwarm(lab, coordinator_host, args, token_file=token_file, state_dir=state_dir)
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
