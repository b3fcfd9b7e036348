"""Secure by default: a node or coordinator bound beyond loopback needs a swarm token or TLS, or says
`--insecure` out loud; deployments make the token themselves (`layerswarm token`)."""

from __future__ import annotations

import base64
import json
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from layerswarm.cli.token import ensure_k8s_secret
from layerswarm.harness.netns import in_private_netns
from layerswarm.harness.procs import coordinator_cmd, node_cmd, spawn, stop_all
from layerswarm.wire.auth import ensure_token_file
from layerswarm.wire.exposure import is_loopback

SHIPPED = "zoo:shapes/layershuffle-0"


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "layerswarm", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_loopback_is_only_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "198.18.0.2", "10.0.0.7", "board.local"))


@pytest.mark.parametrize("command", ["node", "coordinator"])
def test_a_server_bound_beyond_loopback_without_a_secret_refuses_to_start(command: str) -> None:
    """Before: `layerswarm node --host 0.0.0.0` served Forward to anyone on the LAN, without a word."""
    flag = "--host" if command == "node" else "--http-host"
    extra = ["--block", "0", "--no-advertise"] if command == "node" else ["--no-mdns"]
    result = run_cli(command, "--model-dir", SHIPPED, flag, "0.0.0.0", *extra)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith(f"layerswarm {command}: error: {flag} 0.0.0.0 is reachable beyond this machine"), line
    assert "--token-file" in line and "--insecure" in line and len(line.splitlines()) == 1


@pytest.mark.skipif(not in_private_netns(), reason="binds 0.0.0.0: only inside a private network namespace")
def test_insecure_says_so_in_the_log_in_v1_nodes_and_on_the_page(tmp_path: Path) -> None:
    node = spawn("node", node_cmd(Path(SHIPPED), 0, "--no-advertise", "--insecure", host="0.0.0.0"))
    coord = spawn("coordinator", coordinator_cmd(Path(SHIPPED), [node], "--http-host", "0.0.0.0", "--insecure"))
    token = tmp_path / "token"
    token.write_text("t" * 64)
    guarded_cmd = coordinator_cmd(Path(SHIPPED), [], "--http-host", "0.0.0.0", f"--token-file={token}")
    guarded = spawn("coordinator", guarded_cmd)
    try:
        assert any("--insecure: serving on 0.0.0.0 without a swarm token or TLS" in line for line in node.output)
        assert any("--insecure: serving on 0.0.0.0" in line and "WARNING" in line for line in coord.output)
        with httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=10) as client:
            notice = client.get("/v1/nodes").json()["insecure"]
            assert notice and notice.startswith("--insecure: serving on 0.0.0.0")
            assert client.get("/v1/swarm").json()["swarm"]["insecure"] == notice
            assert 'id="insecure"' in client.get("/").text
        with httpx.Client(base_url=f"http://127.0.0.1:{guarded.ready['port']}", timeout=10) as client:
            assert client.get("/v1/nodes").json()["insecure"] is None  # a token guards it: nothing to say
    finally:
        stop_all([guarded, coord, node])


def test_token_file_is_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "swarm.token"
    first = run_cli("token", str(path))
    assert first.returncode == 0 and first.stdout.strip() == f"made a new swarm token in {path}", first.stderr
    token = path.read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0 and stat.S_IMODE(path.stat().st_mode) == 0o600
    again = run_cli("token", str(path))
    assert again.stdout.strip() == f"kept the swarm token in {path}" and path.read_text().strip() == token
    assert run_cli("token").returncode == 2  # neither a file nor --k8s-secret: one line naming both


def test_concurrent_makers_on_a_shared_volume_agree_on_one_token(tmp_path: Path) -> None:
    path = tmp_path / "swarm.token"
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: ensure_token_file(path), range(16)))
    assert made.count(True) == 1 and len(path.read_text().strip()) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["swarm.token"]  # nothing left aside


class FakeKubernetes(BaseHTTPRequestHandler):
    """The two calls `layerswarm token --k8s-secret` makes: GET the Secret, POST a new one."""

    secrets: dict[str, dict[str, Any]] = {}  # noqa: RUF012 (one test's fake API)
    seen: list[tuple[str, str, str]] = []  # noqa: RUF012

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path, self.headers.get("Authorization", "")))
        name = self.path.rsplit("/", 1)[-1]
        self._answer(200 if name in self.secrets else 404, self.secrets.get(name, {}))

    def do_POST(self) -> None:
        self.seen.append(("POST", self.path, self.headers.get("Authorization", "")))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = body["metadata"]["name"]
        if name in self.secrets:
            self._answer(409, {})
            return
        self.secrets[name] = body
        self._answer(201, body)

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def kubernetes() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKubernetes)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_kubernetes_job_makes_the_secret_once(kubernetes: str, tmp_path: Path) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "namespace").write_text("layerswarm")
    (account / "token").write_text("sa-token")
    assert ensure_k8s_secret("layerswarm-token", kubernetes, account) is True
    secret = FakeKubernetes.secrets["layerswarm-token"]
    assert len(base64.b64decode(secret["data"]["token"]).decode()) == 64
    assert ensure_k8s_secret("layerswarm-token", kubernetes, account) is False  # kept: never replaced
    assert FakeKubernetes.secrets["layerswarm-token"] is secret
    assert {(m, p) for m, p, _ in FakeKubernetes.seen} == {
        ("GET", "/api/v1/namespaces/layerswarm/secrets/layerswarm-token"),
        ("POST", "/api/v1/namespaces/layerswarm/secrets"),
    }
    assert all(auth == "Bearer sa-token" for _, _, auth in FakeKubernetes.seen)
