"""Self-speculative decoding on an emulated LAN (part of a full `bench --only generation`): speculation.py's
comparison with every node on a host of its own, each host's link shaped to 100 Mbit/s.

    python -m layerswarm.bench.speculation_lan [--quick] [--delay-ms D] [--json out.json] [--markdown out.md]

One network namespace per host on a bridge (harness/netlab.py), every host link shaped with tc tbf in both
directions (harness/shaping.py), as the edge-LAN benchmark builds it; the coordinator runs in this
process's namespace, on the bridge. tbf limits the rate, it adds no delay (this kernel has no netem), so
a hop costs what a 100 Mbit/s link adds to a few hundred bytes plus the veth and bridge: a trip costs a
little more than on loopback, far less than on a real LAN. `--delay-ms D`: the hosts hang off a
user-space switch instead (harness/delayswitch.py), every host link 100 Mbit/s each way and D ms one way
from host to host, so a hop's round trip costs 2D more, as on a LAN with latency. Needs root; re-executes
itself in a private network namespace (nothing here touches a real interface).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from layerswarm.harness.delayswitch import Link
from layerswarm.harness.netlab import NetLab
from layerswarm.harness.netns import bench_in_private_netns, in_private_netns
from layerswarm.harness.procs import node_cmd, spawn_many, stop_all
from layerswarm.harness.shaping import shaped_hosts
from layerswarm.models.checkpoint import read_lm_manifest
from layerswarm.wire.auth import ensure_token_file

from . import emit_table
from .machine import environment
from .speculation import compare, member_dir

LINK_MBIT = 100


def run_here(quick: bool, delay_ms: float | None) -> dict[str, Any]:
    member = member_dir()
    depth = read_lm_manifest(member).config.depth
    link = None if delay_ms is None else Link(LINK_MBIT, delay_ms / 1000)
    # Nodes on LAN addresses need the swarm's token (secure by default): one made for this run.
    with NetLab(link=link) as lab, tempfile.TemporaryDirectory() as tmp:
        token = Path(tmp) / "swarm.token"
        ensure_token_file(token)
        secured = ("--token-file", str(token))
        hosts = shaped_hosts(lab, depth, "g", LINK_MBIT)
        quick_stop = ("--no-advertise", "--grace", "0.2", *secured)
        specs = [
            (f"lan-lm-{b}", host.command(node_cmd(member, b, *quick_stop, host=host.address)))
            for b, host in enumerate(hosts)
        ]
        procs = spawn_many(specs, timeout=300)
        try:
            result = compare(member, procs, 2 if quick else 6, 2.5, *secured)
        finally:
            stop_all(procs)
    if link is None:
        return {**result, "link_mbit": LINK_MBIT, "shaping": "tc tbf, both directions of every host link"}
    shaping = f"a user-space switch: {LINK_MBIT} Mbit/s each way on every host link, {delay_ms} ms one way"
    return {**result, "link_mbit": LINK_MBIT, "one_way_delay_ms": delay_ms, "shaping": shaping}


def run(quick: bool, delay_ms: float | None = None) -> dict[str, Any]:
    """The comparison, in a private network namespace (re-executed there when this one is not)."""
    if in_private_netns():
        return run_here(quick, delay_ms)
    extra = () if delay_ms is None else ("--delay-ms", str(delay_ms))
    result = bench_in_private_netns("layerswarm.bench.speculation_lan", quick, extra)
    result.pop("environment", None)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 6")
    parser.add_argument(
        "--delay-ms", type=float, help="hosts on a delaying switch, D ms one way between hosts (default: tbf, no delay)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    if args.delay_ms is not None and not 0 <= args.delay_ms <= 100:
        parser.error("--delay-ms must be between 0 and 100")
    logging.basicConfig(level=logging.WARNING)
    report = {"environment": environment(), **run(args.quick, args.delay_ms)}
    return emit_table(report, json.dumps(report, indent=1), args.json, args.markdown)


if __name__ == "__main__":
    raise SystemExit(main())
