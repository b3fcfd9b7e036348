"""Write a deploy/push-nodes.sh plan: spread models' blocks over devices by their free memory.

    python deploy/make_plan.py --model-dir zoo:shapes/layershuffle-0 --copies 2 \\
        --device pi-1.local:3000:cpu --device pi-2.local:3000:cpu --device pi-3.local:3000:cpu > plan.txt

Each --device is HOST:FREE_MB:DEVICE (HOST may be USER@HOST; DEVICE: cpu, cuda, cuda:N, auto). Every
block gets --copies nodes, each on a different host, so losing one device loses no block while a copy
is left. Blocks go, one copy at a time, to the device with the most memory per node it would then hold
(bigger devices host more), never to one without room for the node: NODE_MB for the process plus twice
the block's weights. Ports count up from --first-port on each host, never used twice on one host.

--model-dir may be given more than once (two models in one plan share the hosts' ports without
clashing); a path or a shipped model's zoo:FAMILY/MEMBER name, written to the plan as its path.

`--check PLAN` reads a plan (this script's or one written by hand) and prints it as push-nodes.sh uses
it, with each model's id, or one line naming what is wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

# One node's resident memory (RSS) before its block's weights: 263.2 MiB measured by
# `python -m layerswarm.bench.nodes --reps 3` (median of 3 idle nodes serving a shipped block; torch
# 2.13.0+cpu, x86_64, 2 cores, 2026-11-27; docs/home-lan.md). ~104 MiB of it is torch's libraries,
# shared between the nodes of one host, but a plan does not count on it. Other builds (aarch64) differ:
# measure yours with that command and pass --node-mb.
NODE_MB = 264
FIRST_PORT = 50051
METRICS_OFFSET = 1000  # push-nodes.sh serves each node's Prometheus metrics at its port + 1000
MAX_PORT = 65535 - METRICS_OFFSET
DEVICES = ("auto", "cpu", "cuda", "mps")


class PlanError(Exception):
    """A mistake in the arguments or the plan file: one line, naming the argument or the line."""


@dataclass(frozen=True)
class Device:
    host: str
    free_mb: float
    kind: str


@dataclass(frozen=True)
class Row:
    """One line of a plan: a node serving `block` of the model in `model_dir` on `host`."""

    host: str
    block: int
    model_dir: Path
    device: str
    port: int

    def line(self) -> str:
        return f"{self.host}  {self.block}  {self.model_dir}  {self.device}  {self.port}"


def model_path(spec: str, flag: str = "--model-dir") -> Path:
    """A model directory from a path or zoo:FAMILY/MEMBER; PlanError unless it holds a manifest."""
    if spec.startswith("zoo:"):
        try:
            from layerswarm.models.zoo import resolve  # noqa: PLC0415 - optional: plans of plain paths need no install
        except ImportError:
            raise PlanError(f"{flag} {spec}: zoo: names need layerswarm installed (pip install -e '.[node]')") from None
        try:
            path = resolve(spec)
        except ValueError as exc:
            raise PlanError(f"{flag} {exc}") from None
    else:
        path = Path(spec)
    if not (path / "manifest.json").is_file():
        raise PlanError(f"{flag} {spec}: not a model directory (no manifest.json)")
    return path.resolve()


def manifest(model_dir: Path) -> dict[str, object]:
    try:
        data = json.loads((model_dir / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"{model_dir}/manifest.json: unreadable ({exc})") from None
    if not isinstance(data, dict) or "model_id" not in data or "depth" not in data.get("config", {}):
        raise PlanError(f"{model_dir}/manifest.json: not a layerswarm manifest (no model_id or config.depth)")
    return data


def block_file(model_dir: Path, block: int) -> Path:
    path = model_dir / f"block_{block:02d}.safetensors"
    if not path.is_file():
        raise PlanError(f"{model_dir}: no {path.name}")
    return path


def check_device(kind: str, where: str) -> str:
    name, _, index = kind.partition(":")
    if name not in DEVICES or (index and (name != "cuda" or not index.isdigit())):
        raise PlanError(f"{where}: device {kind!r} is not one of auto, cpu, cuda, cuda:N, mps")
    return kind


def parse_device(spec: str) -> Device:
    host, _, rest = spec.partition(":")
    free, _, kind = rest.partition(":")
    where = f"--device {spec}"
    if not host or not kind:
        raise PlanError(f"{where}: expected HOST:FREE_MB:DEVICE, e.g. pi-1.local:3000:cpu")
    try:
        free_mb = float(free)
    except ValueError:
        raise PlanError(f"{where}: FREE_MB {free!r} is not a number") from None
    if not free_mb > 0:
        raise PlanError(f"{where}: FREE_MB must be above 0")
    return Device(host, free_mb, check_device(kind, where))


def plan(
    model_dirs: list[Path], devices: list[Device], copies: int, node_mb: float, first_port: int = FIRST_PORT
) -> list[Row]:
    """Every block of every model, `copies` times, each copy on another host (see the module's doc)."""
    hosts = [d.host for d in devices]
    if len(set(hosts)) != len(hosts):
        raise PlanError(f"--device: {sorted(h for h in set(hosts) if hosts.count(h) > 1)[0]} is given twice")
    if copies > len(devices):
        raise PlanError(
            f"--copies {copies}: needs at least {copies} --device hosts (each copy on its own), got {len(devices)}"
        )
    total = {d.host: d.free_mb for d in devices}
    free = dict(total)
    held = dict.fromkeys(total, 0)
    ports = dict.fromkeys(total, first_port - 1)
    kind = {d.host: d.kind for d in devices}
    rows: list[Row] = []
    for model_dir in model_dirs:
        depth = int(manifest(model_dir)["config"]["depth"])  # type: ignore[index]
        for block in range(depth):
            need = node_mb + 2 * block_file(model_dir, block).stat().st_size / 2**20
            holding: set[str] = set()
            for copy in range(copies):
                fits = [h for h in total if free[h] >= need and h not in holding]
                if not fits:
                    raise PlanError(
                        f"no device left with {need:.0f} MB for copy {copy + 1} of block {block} of {model_dir.name} "
                        "(each copy on another host): add a --device or free memory"
                    )
                host = max(fits, key=lambda h: (total[h] / (held[h] + 1), h))
                free[host] -= need
                held[host] += 1
                holding.add(host)
                ports[host] += 1
                if ports[host] > MAX_PORT or ports[host] - first_port >= METRICS_OFFSET:
                    raise PlanError(f"--first-port {first_port}: {host} runs out of ports (or into its metrics ports)")
                rows.append(Row(host, block, model_dir, kind[host], ports[host]))
    return rows


def read_plan(path: Path) -> list[tuple[Row, str]]:
    """The rows of a plan file with each model's id; PlanError names the line at fault."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the plan ({exc.strerror})") from None
    rows: list[tuple[Row, str]] = []
    seen_port: dict[tuple[str, int], int] = {}
    seen_block: dict[tuple[str, str, int], int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        fields = line.split()
        if len(fields) != 5:
            raise PlanError(f"{where}: expected HOST BLOCK MODEL_DIR DEVICE PORT, got {len(fields)} fields")
        host, block_text, dir_text, device, port_text = fields
        if not (block_text.isdigit() and port_text.isdigit() and 0 < int(port_text) <= MAX_PORT):
            raise PlanError(f"{where}: BLOCK must be a whole number and PORT one in 1-{MAX_PORT} (metrics: PORT+1000)")
        block, port = int(block_text), int(port_text)
        model_dir = model_path(dir_text, flag=f"{where}: MODEL_DIR")  # relative: to the current folder
        try:
            model_id = str(manifest(model_dir)["model_id"])
            block_file(model_dir, block)
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None
        check_device(device, where)
        for taken in (port, port + METRICS_OFFSET):
            if (host, taken) in seen_port:
                raise PlanError(f"{where}: port {taken} on {host} is taken by line {seen_port[host, taken]}")
        if (host, model_id, block) in seen_block:
            raise PlanError(
                f"{where}: block {block} of {model_dir.name} is on {host} already (line "
                f"{seen_block[host, model_id, block]}); copies belong on different hosts"
            )
        seen_port[host, port] = seen_port[host, port + METRICS_OFFSET] = seen_block[host, model_id, block] = number
        rows.append((Row(host, block, model_dir, device, port), model_id))
    if not rows:
        raise PlanError(f"{path}: no plan lines (HOST BLOCK MODEL_DIR DEVICE PORT)")
    return rows


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="make_plan.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model-dir", action="append", metavar="DIR", help="model directory or zoo:FAMILY/MEMBER (repeatable)"
    )
    parser.add_argument(
        "--device", action="append", metavar="HOST:FREE_MB:DEVICE", help="a device and its free memory (repeatable)"
    )
    parser.add_argument(
        "--copies",
        type=int,
        default=1,
        help="nodes per block, each on another host (default: 1; 2 survives a lost device)",
    )
    parser.add_argument(
        "--node-mb",
        type=float,
        default=NODE_MB,
        help=f"memory of one node before its weights (default: {NODE_MB}, measured)",
    )
    parser.add_argument(
        "--first-port",
        type=int,
        default=FIRST_PORT,
        help=f"first gRPC port on each host (default: {FIRST_PORT}; metrics on port + {METRICS_OFFSET})",
    )
    parser.add_argument("--check", type=Path, metavar="PLAN", help="read PLAN and print it as push-nodes.sh uses it")
    args = parser.parse_args(argv)
    if args.check is None and not (args.model_dir and args.device):
        parser.error("--model-dir and --device are required (or --check PLAN)")
    if args.copies < 1:
        parser.error(f"--copies {args.copies}: must be at least 1")
    if not args.node_mb > 0:
        parser.error(f"--node-mb {args.node_mb}: must be above 0")
    if not 0 < args.first_port <= MAX_PORT:
        parser.error(f"--first-port {args.first_port}: must be in 1-{MAX_PORT} (metrics: port + {METRICS_OFFSET})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.check is not None:
            for row, model_id in read_plan(args.check):
                print(f"{row.line()}  {model_id}")
            return 0
        model_dirs = [model_path(spec) for spec in args.model_dir]
        rows = plan(model_dirs, [parse_device(d) for d in args.device], args.copies, args.node_mb, args.first_port)
    except PlanError as exc:
        print(f"make_plan.py: error: {exc}", file=sys.stderr)
        return 2
    for spec, path in zip(args.model_dir, model_dirs, strict=True):
        if spec != str(path):
            print(f"# {spec} = {path}")
    copies = f"{args.copies} cop{'y' if args.copies == 1 else 'ies'}"
    print(f"# {copies} of each block; a node is {args.node_mb:.0f} MB + twice its weights")
    print("# host  block  model_dir  device  port")
    for row in rows:
        print(row.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
