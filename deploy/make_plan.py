"""Write a push-nodes.sh plan: spread a model's blocks over devices by their free memory.

    python deploy/make_plan.py --model-dir models/zoo/shapes/layershuffle-0 \
        --device jetson-orin-1.local:8000:cuda --device pi5-3.local:2000:cpu > plan.txt

Each --device is HOST:FREE_MB:DEVICE. Blocks go, one at a time, to the device with the most memory
per block it would then hold, so devices host blocks in proportion to their memory (and spread the
risk of losing one), and no device is given more than fits (a working-memory allowance per block).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PORT = 50051
OVERHEAD_MB = 200  # one node process: Python, torch and gRPC, before weights


def plan(model_dir: Path, devices: list[tuple[str, float, str]]) -> list[tuple[str, int, str, str, int]]:
    manifest = json.loads((model_dir / "manifest.json").read_text())
    depth = int(manifest["config"]["depth"])
    total = {host: mb for host, mb, _ in devices}
    free = dict(total)
    held = dict.fromkeys(total, 0)
    kind = {host: dev for host, _, dev in devices}
    ports: dict[str, int] = {}
    rows = []
    for block in range(depth):
        need = OVERHEAD_MB + 2 * (model_dir / f"block_{block:02d}.safetensors").stat().st_size / 2**20
        fits = [h for h in free if free[h] >= need]
        if not fits:
            raise SystemExit(f"make_plan: no device has {need:.0f} MB left for block {block}")
        host = max(fits, key=lambda h: (total[h] / (held[h] + 1), h))
        free[host] -= need
        held[host] += 1
        port = ports[host] = ports.get(host, PORT - 1) + 1
        rows.append((host, block, str(model_dir), kind[host], port))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--device", action="append", required=True, help="HOST:FREE_MB:DEVICE (repeatable)")
    args = parser.parse_args()
    devices = []
    for spec in args.device:
        host, mb, dev = spec.rsplit(":", 2)
        devices.append((host, float(mb), dev))
    print("# host  block  model_dir  device  port")
    for row in plan(args.model_dir, devices):
        print("  ".join(str(v) for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
