"""Python 3.10, which the package declares and the Jetson images run, while the venv runs 3.11.

On 3.10 `asyncio.TimeoutError` is not the builtin `TimeoutError` (3.11 made them one), so a handler that
names only the builtin lets an `asyncio.wait_for` timeout through as a crash; on 3.11 no test can tell
the two apart, so the handlers are checked on the source. And `tomllib` is 3.11's: the CLI imported it
at the top, so every command failed on 3.10 before it parsed a flag; the probe, which a container's
HEALTHCHECK runs, is run here by a real CPython 3.10 when the machine has one (pyenv).
"""

from __future__ import annotations

import ast
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
NOT_YET: tuple[Path, ...] = ()
ASYNCIO_TIMEOUTS = {"wait_for", "timeout", "timeout_at"}


def awaits_an_asyncio_timeout(body: list[ast.stmt]) -> bool:
    """Whether the statements call asyncio.wait_for (or asyncio.timeout/timeout_at) anywhere in them."""
    for statement in body:
        for node in ast.walk(statement):
            func = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(func, ast.Attribute)
                and ast.unparse(func.value) == "asyncio"
                and func.attr in ASYNCIO_TIMEOUTS
            ):
                return True
    return False


def caught(expr: ast.expr) -> set[str]:
    return {ast.unparse(e) for e in (expr.elts if isinstance(expr, ast.Tuple) else [expr])}


def builtin_only_timeout_handlers(source: str) -> list[int]:
    """Lines of `except` clauses and `suppress(...)` blocks guarding an asyncio timeout that catch the
    builtin TimeoutError but not asyncio.TimeoutError (what 3.10 raises)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Try) and awaits_an_asyncio_timeout(node.body):
            for handler in node.handlers:
                names = caught(handler.type) if handler.type is not None else set()
                if "TimeoutError" in names and "asyncio.TimeoutError" not in names:
                    lines.append(handler.lineno)
        if isinstance(node, ast.With | ast.AsyncWith) and awaits_an_asyncio_timeout(node.body):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("suppress"):
                    names = {ast.unparse(arg) for arg in call.args}
                    if "TimeoutError" in names and "asyncio.TimeoutError" not in names:
                        lines.append(node.lineno)
    return lines


def sources() -> Iterator[Path]:
    for folder in (SRC / "layerswarm", ROOT / "tests", ROOT / "scripts"):
        for path in sorted(folder.rglob("*.py")):
            if not any(path.is_relative_to(skipped) for skipped in NOT_YET):
                yield path


def test_asyncio_timeouts_are_caught_as_python_3_10_raises_them() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sources()
        for line in builtin_only_timeout_handlers(path.read_text())
    ]
    assert not found, f"catch asyncio.TimeoutError too (not the builtin before Python 3.11): {found}"


def test_the_timeout_check_sees_a_builtin_only_handler() -> None:
    """The check is live: the handler shapes the suite fixed are found, the fixed ones are not."""
    wrong = (
        "async def f():\n"
        "    try:\n"
        "        await asyncio.wait_for(g(), 1)\n"
        "    except TimeoutError:\n"
        "        pass\n"
        "    with contextlib.suppress(TimeoutError):\n"
        "        await asyncio.wait_for(g(), 1)\n"
    )
    assert builtin_only_timeout_handlers(wrong) == [4, 6]
    right = wrong.replace("(TimeoutError)", "(asyncio.TimeoutError)").replace(
        "except TimeoutError:", "except (TimeoutError, asyncio.TimeoutError):"
    )
    assert builtin_only_timeout_handlers(right) == []
    unrelated = "def f():\n    try:\n        wait_for_ready_line(p)\n    except TimeoutError:\n        pass\n"
    assert builtin_only_timeout_handlers(unrelated) == []  # a builtin raised by our own code: right as it is


def python_3_10() -> Path | None:
    """A CPython 3.10 interpreter of pyenv's, if this machine has one."""
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(versions.glob("3.10.*/bin/python")) if versions.is_dir() else []
    return found[-1] if found else None


class Answer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/readyz" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.mark.skipif(python_3_10() is None, reason="no CPython 3.10 under pyenv")
def test_the_probe_runs_on_python_3_10() -> None:
    """`layerswarm probe http` on a bare CPython 3.10 (the source on its path, no packages: the probe
    needs none): exit 0 on 200, 1 on 503. Before, importing the CLI failed on `import tomllib`."""
    python = python_3_10()
    assert python is not None
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        codes = {}
        for path in ("/readyz", "/other"):
            cmd = [str(python), "-m", "layerswarm", "probe", "http", base + path, "--timeout", "5"]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)
            assert "Traceback" not in done.stderr, done.stderr
            codes[path] = done.returncode
    finally:
        server.shutdown()
        server.server_close()
    assert codes == {"/readyz": 0, "/other": 1}
