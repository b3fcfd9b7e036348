"""A home LAN in the first hour (issue 46), tried end to end, and the address rule it depends on.

The three-board test follows docs/home-lan.md: three "boards" (tests/board_lab.py: network and mount
namespaces on one bridge, each running the distribution's OpenSSH server with a login `pi` and a key
the test makes), a plan from deploy/make_plan.py with two copies of every block on different boards,
provisioned over real ssh by deploy/push-nodes.sh --install (venv, wheel, token, units), a coordinator
on the "laptop" that finds the nodes over mDNS inside the lab and needs the token and an API key; then
one board is powered off under load. Every request must be answered (its request log: 0 failures, no
retries) and the lost redundancy alerted: layerswarm_block_nodes falls to 1 for that board's blocks,
and, where Prometheus is installed, the shipped LayerswarmBlockWithoutSpare rule is active for exactly
those blocks.

Not real, and why: systemd cannot run inside a plain network namespace, so a board's `systemctl` is
tests/home_lan_board/systemctl, which runs the unit's ExecStartPre and ExecStart with its
EnvironmentFile, WorkingDirectory and %h/%i as systemd would (the same command line the unit runs);
`loginctl enable-linger` is a no-op; the runtime's dependencies come from the board's system Python (a
.pth to this venv) instead of three downloads of torch (VENV_ARGS=--system-site-packages, PIP_ARGS="--no-index
--no-deps"; the install step's own check, `layerswarm node --help` in the new venv, proves they import).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from layerswarm.client import SwarmClient, SwarmError
from layerswarm.harness.netlab import Host, NetLab
from layerswarm.harness.procs import Proc, launch, layerswarm_cmd, stop_all, wait_for_ready_line

from .. import board_lab
from ..coordinator.test_kserve import png

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")


def wait_for(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def healthy_nodes(url: str, key: str | None = None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        nodes: list[dict[str, Any]] = httpx.get(f"{url}/v1/nodes", headers=headers, timeout=5).json()["nodes"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return [n for n in nodes if n["state"] == "healthy"]


# --- the address a node advertises -------------------------------------------------------------------


def test_a_bad_advertise_address_is_one_line_naming_the_flag(model_dir: Path) -> None:
    argv = ["node", "--model-dir", str(model_dir), "--block", "0", "--advertise-address", "wlan9"]
    done = subprocess.run(layerswarm_cmd(*argv), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("layerswarm node: error: --advertise-address wlan9:")


def test_an_interface_name_advertises_its_address() -> None:
    from layerswarm.node.advertise import advertised_addresses

    assert advertised_addresses("0.0.0.0", "lo").addresses == ["127.0.0.1"]
    assert advertised_addresses("0.0.0.0", "10.0.0.7").addresses == ["10.0.0.7"]
    assert advertised_addresses("127.0.0.1").addresses == ["127.0.0.1"]  # bound to one address: that one


@pytest.mark.slow
@pytest.mark.netns
def test_node_bound_to_all_advertises_its_route_to_the_lan(model_dir: Path) -> None:
    """A node host whose first interface is a bridge of its own (docker0, listed before eth0, as on a
    board running Docker): bound to 0.0.0.0 it must advertise its LAN address (the default route's
    source), which a coordinator on another host reaches; advertising docker0's first fails that."""
    reason = NetLab.available()
    if reason:
        pytest.skip(reason)
    procs: list[Proc] = []
    with NetLab() as lab:
        board = lab.add_host("board", links_first=[("docker0", "172.17.0.1/16")])
        laptop = lab.add_host("laptop")
        subprocess.run(board.command(["ip", "route", "add", "default", "via", lab.gateway]), check=True)
        ip_addr = board.command(["ip", "-4", "-o", "addr"])
        listed = subprocess.run(ip_addr, capture_output=True, text=True, check=True).stdout
        assert [line.split()[1] for line in listed.splitlines()][1:] == ["docker0", "eth0"]  # docker0 first
        try:
            cmd = layerswarm_cmd(
                "node", "--model-dir", str(model_dir), "--block", "0", "--host", "0.0.0.0", "--insecure"
            )
            node = wait_for_ready_line(launch("node", board.command([*cmd, "--port", "50051"])))
            procs.append(node)
            assert node.ready["advertised"] == [board.address], node.ready
            assert "default route" in node.ready["advertised_by"]
            coord_cmd = layerswarm_cmd(
                "coordinator", "--model-dir", str(model_dir), "--http-host", laptop.address, "--insecure"
            )
            procs.append(wait_for_ready_line(launch("coordinator", laptop.command(coord_cmd))))
            url = f"http://{laptop.address}:{procs[-1].ready['port']}"
            nodes = wait_for("the node healthy", lambda: healthy_nodes(url), 30)
            assert [n["address"] for n in nodes] == [f"{board.address}:50051"]
        finally:
            stop_all(procs)


# --- three boards and a laptop -----------------------------------------------------------------------


class RequestLog:
    """Every request the load sends, one JSON line each: when, the answer or the error. No retries
    (attempts=1): a request the swarm failed is a failure here, not hidden by the client."""

    def __init__(self, path: Path, url: str, key: str) -> None:
        self.path, self.url, self.key = path, url, key
        self.entries: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.lost_at = float("inf")  # when the board went down
        self._lock = threading.Lock()

    def run(self, worker: int) -> None:
        with SwarmClient(self.url, api_key=self.key, attempts=1, timeout=30) as swarm:
            seed = worker
            while not self.stop.is_set() and seed < 2000:
                entry: dict[str, Any] = {"t": time.time(), "worker": worker, "seed": seed}
                try:
                    result = swarm.classify(png(seed), exit_rule="none", seed=seed)
                    nodes = [h.node for h in result.trace.hops]
                    entry |= {"ok": True, "depth": result.depth, "nodes": nodes}
                    if any(h.attempts or h.block is None for h in result.trace.hops):
                        entry["hops"] = [asdict(h) for h in result.trace.hops]  # why: substituted or skipped
                except (SwarmError, httpx.HTTPError) as exc:
                    entry |= {"ok": False, "error": str(exc)}
                entry["s"] = round(time.time() - entry["t"], 3)
                with self._lock:
                    self.entries.append(entry)
                    with self.path.open("a") as log:
                        log.write(json.dumps(entry) + "\n")
                seed += 2

    def start(self, workers: int = 2) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.run, args=(w,), daemon=True) for w in range(workers)]
        for thread in threads:
            thread.start()
        return threads


@pytest.fixture
def lab() -> Iterator[NetLab]:
    reason = board_lab.missing()
    if reason:
        pytest.skip(reason)
    with NetLab() as lab:
        yield lab


def run_deploy(laptop: Host, argv: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(
        laptop.command(argv), capture_output=True, text=True, env={**os.environ, **env}, timeout=timeout, check=False
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def block_gauges(url: str) -> dict[int, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {int(b): float(v) for b, v in re.findall(r'^layerswarm_block_nodes\{block="(\d+)"\} (\S+)$', text, re.M)}


def start_prometheus(laptop: Host, coordinator: str, tmp: Path) -> Proc:
    config = tmp / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(ROOT / "deploy" / "prometheus" / "alerts.yml")],
                "scrape_configs": [{"job_name": "coordinator", "static_configs": [{"targets": [coordinator]}]}],
            }
        )
    )
    assert PROMETHEUS
    argv = [
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address={laptop.address}:9090",
    ]
    return launch("prometheus", laptop.command(argv))


def spare_alerts(laptop: Host) -> dict[str, str]:
    """Block -> state of the active LayerswarmBlockWithoutSpare alerts (pending: the rule's expression
    holds, firing: for its whole `for`)."""
    try:
        alerts = httpx.get(f"http://{laptop.address}:9090/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {
        a["labels"]["block"]: a["state"] for a in alerts if a["labels"]["alertname"] == "LayerswarmBlockWithoutSpare"
    }


def build_wheel(tmp: Path) -> Path:
    """The wheel install-board.sh would build (here without build isolation: no package index in the lab)."""
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(ROOT)]
    subprocess.run(argv, check=True, capture_output=True, timeout=120)
    return next(tmp.glob("layerswarm-*.whl"))


def make_plan(laptop: Host, model: Path, boards: list[board_lab.Board], plan: Path) -> list[list[str]]:
    """docs/home-lan.md's plan: every block twice, each copy on another board."""
    devices = [f"--device={b.host.address}:2000:cpu" for b in boards]
    argv = [sys.executable, str(ROOT / "deploy" / "make_plan.py"), f"--model-dir={model}", "--copies=2", *devices]
    plan.write_text(run_deploy(laptop, argv, {}, 30))
    rows = [line.split() for line in plan.read_text().splitlines() if line and not line.startswith("#")]
    hosts_of: dict[str, list[str]] = {}
    for host, block, *_ in rows:
        hosts_of.setdefault(block, []).append(host)
    assert all(len(set(h)) == len(h) == 2 for h in hosts_of.values()), hosts_of
    return rows


def push(laptop: Host, plan: Path, boards: list[board_lab.Board], rows: list[list[str]], tmp: Path) -> Path:
    """push-nodes.sh --install over ssh, as a login of the boards (not root); the swarm token it makes."""
    token = tmp / "swarm.token"
    env = {
        "SSH_USER": board_lab.LOGIN,
        "SSH_OPTS": f"-F {board_lab.client_config(tmp)}",
        "TOKEN_FILE": str(token),
        "WHEEL": str(build_wheel(tmp / "wheel")),
        "VENV_ARGS": "--system-site-packages",
        "PIP_ARGS": "--no-index --no-deps",  # the dependencies are the board system's (see the top)
        "PYTHON": sys.executable,
    }
    out = run_deploy(laptop, ["bash", str(ROOT / "deploy" / "push-nodes.sh"), "--install", str(plan)], env, 150)
    assert out.count("layerswarm installed in /home/pi/layerswarm/venv") == len(boards), out
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    for board in boards:  # every line of the plan reached its board (none swallowed by an ssh in the loop)
        envs = sorted(p.name for p in (board.home / "layerswarm" / "nodes").glob("*.env"))
        assert len(envs) == sum(r[0] == board.host.address for r in rows), envs
        assert stat.S_IMODE((board.home / "layerswarm" / "swarm.token").stat().st_mode) == 0o600
    return token


def start_coordinator(laptop: Host, model: Path, token: Path, key_file: Path) -> Proc:
    """docs/home-lan.md's coordinator: the swarm token towards nodes, API keys towards clients."""
    argv = layerswarm_cmd(
        "coordinator",
        f"--model-dir={model}",
        f"--http-host={laptop.address}",
        "--http-port=8080",
        f"--token-file={token}",
        f"--api-key-file={key_file}",
    )
    return wait_for_ready_line(launch("coordinator", laptop.command(argv)), 60)


def lose_a_board_under_load(
    log: RequestLog, url: str, key: str, board: board_lab.Board, nodes: set[str], laptop: Host
) -> tuple[dict[int, float], dict[str, str]]:
    """Send requests, power `board` off, go on until its nodes are out and ten more were answered;
    the block gauges and Prometheus's spare alerts then (the log keeps every request)."""
    threads = log.start()
    try:
        wait_for("requests answered", lambda: len(log.entries) >= 10, 60)
        dead = {a for a in nodes if a.startswith(board.host.address + ":")}
        log.lost_at = time.time()
        board.power_off()
        wait_for("the dead nodes out", lambda: not dead & {n["address"] for n in healthy_nodes(url, key)}, 30)
        wait_for("requests after the loss", lambda: sum(e["t"] > log.lost_at + 3 for e in log.entries) >= 10, 60)
        gauges = block_gauges(url)
        alerts = wait_for("the alert", lambda: spare_alerts(laptop), 30) if PROMETHEUS else {}
    finally:
        log.stop.set()
        for thread in threads:
            thread.join(60)
    return gauges, alerts


@pytest.mark.slow
@pytest.mark.netns
def test_three_boards_provisioned_over_ssh_survive_a_dead_board(
    lab: NetLab, family_dirs: list[Path], tmp_path: Path
) -> None:
    model, depth = family_dirs[0], 3
    laptop = lab.add_host("laptop")
    boards: list[board_lab.Board] = []
    procs: list[Proc] = []
    try:
        public_key = (board_lab.client_key(tmp_path)).read_text()
        boards = [board_lab.add_board(lab, f"board{i}", tmp_path / f"board{i}", public_key) for i in (1, 2, 3)]
        rows = make_plan(laptop, model, boards, tmp_path / "plan.txt")
        token = push(laptop, tmp_path / "plan.txt", boards, rows, tmp_path)
        key = "home-lan-" + "k" * 24
        (tmp_path / "api.keys").write_text(key + "\n")
        procs.append(start_coordinator(laptop, model, token, tmp_path / "api.keys"))
        url = f"http://{laptop.address}:8080"
        if PROMETHEUS:
            procs.append(start_prometheus(laptop, f"{laptop.address}:8080", tmp_path))
        expected = {f"{r[0]}:{r[4]}" for r in rows}
        try:
            wait_for("every node healthy", lambda: {n["address"] for n in healthy_nodes(url, key)} == expected, 90)
        except AssertionError:
            raise AssertionError("\n".join(b.node_logs() for b in boards)) from None
        assert all(n["source"] == "mdns" for n in healthy_nodes(url, key))
        assert block_gauges(url) == dict.fromkeys(range(depth), 2.0)

        # Load, then one board loses power.
        log = RequestLog(tmp_path / "requests.jsonl", url, key)
        gauges, alerts = lose_a_board_under_load(log, url, key, boards[0], expected, laptop)
        dead = boards[0].host.address
        dead_blocks = {int(r[1]) for r in rows if r[0] == dead}
        after = [e for e in log.entries if e["t"] > log.lost_at]
        failed = [e for e in log.entries if not e["ok"]]
        assert not failed, json.dumps({"lost_at": log.lost_at, "failed": failed[:5]})  # a string: shown whole
        assert len(after) >= 10
        short = [e for e in log.entries if e["depth"] != depth]
        assert not short, json.dumps({"lost_at": log.lost_at, "short": short[:5]})
        assert not {a for e in after if e["t"] > log.lost_at + 3 for a in e["nodes"] if a.startswith(dead + ":")}
        assert gauges == {b: 1.0 if b in dead_blocks else 2.0 for b in range(depth)}, gauges
        if PROMETHEUS:
            assert set(alerts) == {str(b) for b in dead_blocks}, alerts
        slowest = max(e["s"] for e in log.entries)
        print(f"{len(log.entries)} requests, {len(after)} after the loss, 0 failed, slowest {slowest:.2f} s; {alerts}")
    finally:
        stop_all(procs)
        board_lab.stop_boards(boards)
