"""The address a node advertises: with --host 0.0.0.0, its route toward the LAN (issue 46)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from layerswarm.harness.netlab import NetLab
from layerswarm.harness.procs import Proc, launch, layerswarm_cmd, stop_all, wait_for_ready_line

ROOT = Path(__file__).resolve().parents[1]
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
            cmd = layerswarm_cmd("node", "--model-dir", str(model_dir), "--block", "0", "--host", "0.0.0.0")
            node = wait_for_ready_line(launch("node", board.command([*cmd, "--port", "50051"])))
            procs.append(node)
            assert node.ready["advertised"] == [board.address], node.ready
            assert "default route" in node.ready["advertised_by"]
            coord_cmd = layerswarm_cmd("coordinator", "--model-dir", str(model_dir), "--http-host", laptop.address)
            procs.append(wait_for_ready_line(launch("coordinator", laptop.command(coord_cmd))))
            url = f"http://{laptop.address}:{procs[-1].ready['port']}"
            nodes = wait_for("the node healthy", lambda: healthy_nodes(url), 30)
            assert [n["address"] for n in nodes] == [f"{board.address}:50051"]
        finally:
            stop_all(procs)
