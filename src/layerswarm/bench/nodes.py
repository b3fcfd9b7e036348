"""Node footprint: a node's memory and start-up time, and what one health probe costs.

Two nodes for the same block, interleaved: on the torch engine and on the numpy engine (`--engine numpy`,
no torch imported: the lean node of docs/deploy.md).

A node serving a block of the shipped family is timed from spawn to its ready line, then measured from
/proc: RSS split into anonymous and file-backed pages (file pages, torch's libraries, are shared by every
node on a host and every container of one image), and PSS. The baseline, measured in the same run and
interleaved, is a bare interpreter that imports torch and nothing else: the floor for any process that
computes with torch. The probe (`layerswarm probe grpc`, the image's HEALTHCHECK) is timed against a bare
`python -c pass`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from layerswarm.bench import emit_report
from layerswarm.harness.procs import launch, layerswarm_cmd, node_address, wait_for_ready_line
from layerswarm.models.zoo import family_root, robust_members

TORCH_ONLY = "import json, time, torch; print(json.dumps({'event': 'ready'}), flush=True); time.sleep(600)"
# What a node process imports, in the order it does, grouped: RSS is read after each group, in a fresh
# interpreter, so each step's figure is what that group adds on top of the ones before it.
IMPORT_STEPS = (
    ("numpy (torch imports it)", "numpy"),
    ("torch", "torch"),
    ("grpc, health service, protobuf", "grpc grpc_health.v1.health_pb2 layerswarm.wire.v1.block_pb2_grpc"),
    ("pydantic, pydantic-settings", "pydantic pydantic_settings"),
    ("zeroconf", "zeroconf.asyncio"),
    ("prometheus_client", "prometheus_client"),
    ("layerswarm node modules", "layerswarm.cli.node layerswarm.node.server"),
)
STEP_SCRIPT = """
import importlib, json, sys
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
steps, before = [], rss()
for name, modules in json.loads(sys.argv[1]):
    for module in modules.split():
        importlib.import_module(module)
    steps.append({"step": name, "adds_mib": round(rss() - before, 1)})
    before = rss()
print(json.dumps({"interpreter_mib": round(rss() - sum(s["adds_mib"] for s in steps), 1), "steps": steps}))
"""


def process_memory(pid: int) -> dict[str, float]:
    """RSS, its anonymous and file-backed parts, and PSS of one process, in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Pss":
            fields["Pss"] = value

    def mib(key: str) -> float:
        return round(int(fields[key].split()[0]) / 1024, 1)

    return {
        "rss_mib": mib("VmRSS"),
        "rss_anon_mib": mib("RssAnon"),
        "rss_file_mib": mib("RssFile"),
        "pss_mib": mib("Pss"),
    }


def torch_loaded(pid: int) -> bool:
    """Whether the process mapped torch's library (a lean node must not)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _measure(name: str, cmd: list[str], probe: bool) -> dict[str, Any]:
    """Spawn, wait for the ready line, read memory, probe it (nodes), stop it."""
    started = time.perf_counter()
    proc = wait_for_ready_line(launch(name, cmd), timeout=180)
    try:
        figures: dict[str, Any] = {"start_s": time.perf_counter() - started}
        time.sleep(0.5)  # let start-up garbage be freed before reading memory
        figures.update(process_memory(proc.pid))
        figures["torch_loaded"] = torch_loaded(proc.pid)
        if probe:
            started = time.perf_counter()
            cmd = layerswarm_cmd("probe", "grpc", node_address(proc))
            result = subprocess.run(cmd, capture_output=True, check=False)
            figures["probe_s"] = time.perf_counter() - started
            figures["probe_ok"] = result.returncode == 0
        return figures
    finally:
        proc.stop(5)


def import_breakdown() -> dict[str, Any]:
    """RSS each group of a node's imports adds, in a fresh interpreter (where a node's memory goes)."""
    cmd = [sys.executable, "-c", STEP_SCRIPT, json.dumps(IMPORT_STEPS)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


TORCH_PYTHON_SHARE = """
import json, sys, tracemalloc
tracemalloc.start()
import torch
traced = tracemalloc.get_traced_memory()[0]
modules = sum(name.split(".")[0] == "torch" for name in sys.modules)
print(json.dumps({"python_objects_mib": round(traced / 2**20, 1), "torch_modules": modules}))
"""


def torch_python_share() -> dict[str, Any]:
    """How much of `import torch` is Python objects (traced by tracemalloc; the rest of its RSS is native:
    libraries and operator registrations) and how many torch modules it loads."""
    cmd = [sys.executable, "-c", TORCH_PYTHON_SHARE]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


def probe_http_s(reps: int) -> float:
    """Median seconds of `layerswarm probe http` (the coordinator's HEALTHCHECK) against a local server
    answering 200: the interpreter, the CLI and one HTTP round trip."""

    class Ready(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:  # quiet: the benchmark prints JSON
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Ready) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        cmd = layerswarm_cmd("probe", "http", f"http://127.0.0.1:{server.server_address[1]}/readyz")
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=True)
            times.append(time.perf_counter() - started)
        server.shutdown()
    return round(statistics.median(times), 3)


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(float(r[key]) for r in rows), 3)


def node_footprint(reps: int) -> dict[str, Any]:
    member = robust_members(family_root())[0]
    node_cmd = layerswarm_cmd("node", "--model-dir", str(member), "--block", "0", "--port", "0", "--no-advertise")
    nodes: list[dict[str, Any]] = []
    leans: list[dict[str, Any]] = []
    baselines: list[dict[str, Any]] = []
    bare_s: list[float] = []
    for i in range(reps):  # interleaved: contention from other work hits both alike
        nodes.append(_measure(f"footprint-node-{i}", [*node_cmd, "--engine", "torch"], probe=True))
        leans.append(_measure(f"footprint-lean-{i}", [*node_cmd, "--engine", "numpy"], probe=True))
        baselines.append(_measure(f"footprint-torch-{i}", [sys.executable, "-c", TORCH_ONLY], probe=False))
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare_s.append(time.perf_counter() - started)
    keys = ("start_s", "rss_mib", "rss_anon_mib", "rss_file_mib", "pss_mib")
    node = {k: _median(nodes, k) for k in keys}
    lean = {k: _median(leans, k) for k in keys}
    torch_only = {k: _median(baselines, k) for k in keys}
    probe_s = _median(nodes, "probe_s")
    bare = round(statistics.median(bare_s), 3)
    return {
        "block": f"{member.name} block 0",
        "reps": reps,
        "node": node,
        "lean_node": {**lean, "torch_loaded": any(n["torch_loaded"] for n in leans)},
        "lean_over_torch_node_rss": round(lean["rss_mib"] / node["rss_mib"], 2),
        "lean_over_torch_node_start": round(lean["start_s"] / node["start_s"], 2),
        "torch_only_interpreter": torch_only,
        "node_rss_over_torch_only": round(node["rss_mib"] / torch_only["rss_mib"], 2),
        "node_start_over_torch_only": round(node["start_s"] / torch_only["start_s"], 2),
        "probe_s": probe_s,
        "probe_ok": all(n["probe_ok"] for n in nodes),
        "probe_http_s": probe_http_s(max(3, reps)),
        "bare_python_s": bare,
        "probe_over_bare_python": round(probe_s / bare, 2),
        "imports": {**import_breakdown(), "torch": torch_python_share()},
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m layerswarm.bench.nodes --json FILE`: this part alone (`layerswarm bench` runs it too)."""
    parser = argparse.ArgumentParser(prog="python -m layerswarm.bench.nodes", description=__doc__)
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        **node_footprint(args.reps),
    }
    return emit_report(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
