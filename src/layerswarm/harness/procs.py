"""Start layerswarm processes and wait for their ready line (used by `up`, tests and the chaos harness).

Every server prints one JSON line {"event": "ready", ...} on stdout once it serves; waiting for it
beats polling ports. Processes are ended by PID, only the ones started here.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ProcessError(RuntimeError):
    pass


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    ready: dict[str, Any] = field(default_factory=dict)
    output: list[str] = field(default_factory=list)
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue, repr=False)
    # Errors and tracebacks it printed, kept apart from the rolling `output` tail: a long run (a soak)
    # must still be able to say what went wrong in its first minute.
    errors: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.alive:
            self.signal(signal.SIGCONT)  # a frozen process cannot handle SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode


def layerswarm_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "layerswarm", *args]


def node_cmd(model_dir: Path, block: int, *extra: str, host: str = "127.0.0.1", port: int = 0) -> list[str]:
    """`layerswarm node` serving `block` of `model_dir` (port 0: any free port, reported when ready)."""
    args = ["--model-dir", str(model_dir), "--block", str(block), "--host", host, "--port", str(port)]
    return layerswarm_cmd("node", *args, *extra)


def node_address(proc: Proc) -> str:
    """HOST:PORT at which a node process that reported ready can be reached from this host."""
    host = proc.ready["host"]
    return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{proc.ready['port']}"


def coordinator_cmd(model_dir: Path, peers: Sequence[Proc] | None = None, *extra: str) -> list[str]:
    """`layerswarm coordinator` on a free HTTP port: with `peers`, static peers and no mDNS; with
    None, discovery over mDNS."""
    static = [] if peers is None else ["--no-mdns", *[f"--peer={node_address(p)}" for p in peers]]
    return layerswarm_cmd("coordinator", "--model-dir", str(model_dir), "--http-port", "0", *static, *extra)


def launch(name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> Proc:
    """Start `cmd` (one torch thread unless told otherwise); its output is kept and scanned for readiness."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    popen = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    proc = Proc(name, popen)
    threading.Thread(target=_pump, args=(popen, proc), daemon=True).start()
    return proc


def wait_for_ready_line(proc: Proc, timeout: float = 60.0) -> Proc:
    """Wait for the ready line; raise ProcessError with the process's output if it dies or stalls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = proc.lines.get(timeout=0.1)
        except queue.Empty:
            continue
        if line is None:
            break
        if line.startswith('{"event": "ready"'):
            proc.ready = json.loads(line)
            return proc
    proc.stop(2)
    tail = "".join(proc.output[-30:])
    raise ProcessError(f"{proc.name} did not become ready (exit {proc.popen.returncode}):\n{tail}")


def spawn(name: str, cmd: Sequence[str], timeout: float = 60.0, env: dict[str, str] | None = None) -> Proc:
    return wait_for_ready_line(launch(name, cmd, env), timeout)


def spawn_many(specs: Sequence[tuple[str, Sequence[str]]], timeout: float = 90.0) -> list[Proc]:
    """Start every process first, then wait for each: start-up (imports) overlaps."""
    procs = [launch(name, cmd) for name, cmd in specs]
    try:
        return [wait_for_ready_line(p, timeout) for p in procs]
    except ProcessError:
        stop_all(procs)
        raise


ERROR_MARKS = ("ERROR", "CRITICAL", "Traceback (most recent call last)")
TRACEBACK_LINES = 40  # lines kept after a "Traceback" line (the frames and the exception)
MAX_ERROR_LINES = 400


def _pump(popen: subprocess.Popen[str], proc: Proc) -> None:
    assert popen.stdout is not None
    follow = 0
    for line in popen.stdout:
        proc.output.append(line)
        del proc.output[:-200]  # keep the tail only: bounded memory for long runs
        if "Traceback (most recent call last)" in line:
            follow = TRACEBACK_LINES
        if follow > 0 or any(mark in line for mark in ERROR_MARKS):
            proc.errors.append(line)
            del proc.errors[:-MAX_ERROR_LINES]
            follow -= 1
        proc.lines.put(line)
    proc.lines.put(None)


def stop_all(procs: Sequence[Proc], timeout: float = 10.0) -> None:
    for proc in procs:
        if proc.alive:
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(5)
