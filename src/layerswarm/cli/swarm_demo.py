"""What both `up` demos share: their options, the swarm they start (a node per block of the family's
shuffle-robust members, a coordinator) and which nodes they kill."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class UpOptions:
    nodes: int | None = None  # default: two models per block
    requests_per_phase: int = 40
    kill: int | None = None  # default: a third of the nodes
    mdns: bool = True
    family_dir: Path | None = None
    seed: int = 0
    timeout_s: float = 60.0
    concurrent: int = 0  # requests the demo keeps in flight at once (the coordinator must admit them)
    victims: str = "whole-index"  # which nodes die: every node of one block index too, or spread (VICTIMS)


VICTIMS = {
    "whole-index": "every node of one block index and random others (a skip or a cross-block substitution)",
    "spread": "random nodes, never the last of a block index (every loss is rebuilt on another replica)",
}


def family_members(family_dir: Path) -> tuple[list[Path], int]:
    """The family's shuffle-robust members (the ones a swarm mixes and reorders) and their depth."""
    from layerswarm.models.checkpoint import read_any_manifest
    from layerswarm.models.zoo import robust_members

    members = robust_members(family_dir)
    if not members:
        raise ValueError(f"{family_dir} holds no shuffle-robust model (a swarm reorders blocks)")
    return members, read_any_manifest(members[0]).config.depth


def is_decoder_family(family_dir: Path) -> bool:
    """Whether the family's models are language models (the streaming demo) rather than classifiers."""
    from layerswarm.models.checkpoint import read_any_manifest
    from layerswarm.models.manifest import is_lm

    return is_lm(read_any_manifest(family_members(family_dir)[0][0]))


def progress(message: str) -> None:
    """What `up` is doing, as it goes: on stderr, so that --json keeps stdout to one JSON object."""
    print(f"layerswarm up: {message}", file=sys.stderr, flush=True)


def start_swarm(opts: UpOptions) -> tuple[list[Any], Any, list[Path]]:
    from layerswarm.harness.procs import coordinator_cmd, node_cmd, spawn, spawn_many, stop_all
    from layerswarm.harness.swarm import node_layout
    from layerswarm.models.zoo import family_root

    members, depth = family_members(opts.family_dir or family_root())
    count = opts.nodes or depth * min(2, len(members))
    mdns = [] if opts.mdns else ["--no-advertise"]
    held = stream_flags(opts.concurrent)
    specs = [(f"node-{i}", node_cmd(d, b, *mdns, *held)) for i, (d, b) in enumerate(node_layout(members, depth, count))]
    models = f"{len(members)} model{'s' if len(members) != 1 else ''}"
    progress(block_rule(members[0], demo_min_blocks(depth)))
    progress(f"starting {count} nodes ({depth} blocks from {models} of the family)...")
    nodes = spawn_many(specs, opts.timeout_s * 2)
    try:
        family = [f"--family-dir={m}" for m in members[1:]]
        degraded = ["--min-blocks", str(demo_min_blocks(depth))]
        admit = admission_flags(opts.concurrent)
        cmd = coordinator_cmd(
            members[0], None if opts.mdns else nodes, "--health-interval", "0.5", *family, *degraded, *admit
        )
        progress(f"{count} nodes serving; starting the coordinator ({'mDNS' if opts.mdns else 'static peers'})...")
        coordinator = spawn("coordinator", cmd, opts.timeout_s)
    except Exception:
        stop_all(nodes)
        raise
    return nodes, coordinator, members


def admission_flags(concurrent: int) -> list[str]:
    """More streams at once than a coordinator admits by default would be answered 429 (busy): the demo
    raises the limit to its own load and says so; a client of a real deployment retries 429."""
    from layerswarm.coordinator.settings import CoordinatorSettings

    default = int(CoordinatorSettings.model_fields["max_concurrent_requests"].default)
    if concurrent <= default:
        return []
    progress(f"{concurrent} streams at once: --max-concurrent-requests {concurrent} (the default admits {default})")
    return ["--max-concurrent-requests", str(concurrent)]


def stream_flags(concurrent: int) -> list[str]:
    """A decoder node keeps the caches of max_streams streams and evicts the least recently used past
    it: more streams at once than that would rebuild each other's caches over and over."""
    from layerswarm.node.settings import NodeSettings

    default = int(NodeSettings.model_fields["max_streams"].default)
    if concurrent <= default:
        return []
    progress(f"{concurrent} streams at once: nodes get --max-streams {concurrent} (the default holds {default})")
    return ["--max-streams", str(concurrent)]


def demo_min_blocks(depth: int) -> int:
    """The demo kills every node of one block index to show a degraded answer, so it accepts one block
    fewer than the evaluated minimum depth a coordinator defaults to (manifest policy)."""
    return max(1, depth - 1)


def block_rule(model_dir: Path, min_blocks: int) -> str:
    """How many blocks must answer in this run and where that number came from, by the coordinator's own
    rule (coordinator/assembly.py, routing/depth.py); and what a coordinator started by hand would need."""
    from layerswarm.coordinator.assembly import depth_rule, readiness_minimum
    from layerswarm.coordinator.settings import CoordinatorSettings
    from layerswarm.models.checkpoint import read_any_manifest, read_manifest
    from layerswarm.models.manifest import is_lm

    manifest = read_any_manifest(model_dir)
    default, source = readiness_minimum(CoordinatorSettings(model_dir=model_dir), manifest)
    depth = manifest.config.depth
    if is_lm(manifest):  # a stream may skip a block it lost down to this many (its route, not a request's)
        rule = f"a stream keeps at least {min_blocks} of {depth} blocks (--min-blocks)"
    else:
        classifier = read_manifest(model_dir)
        rule = depth_rule(CoordinatorSettings(model_dir=model_dir, min_blocks=min_blocks), classifier).describe()
    return (
        f"block rule: {rule}. `up` passes --min-blocks {min_blocks} because it kills every node of "
        f"one block index; a coordinator started without --min-blocks needs {default} of {depth} ({source})"
    )


def choose_victims(nodes: list[Any], count: int, rng: random.Random, how: str = "whole-index") -> list[Any]:
    """Up to `count` nodes to kill (VICTIMS): with whole-index, every node of one block index first; the
    others at random, leaving every other index at least one node."""
    if count <= 0:
        return []
    by_block: dict[int, list[Any]] = {}
    for proc in nodes:
        by_block.setdefault(int(proc.ready["block"]), []).append(proc)
    first = by_block[rng.choice(sorted(by_block))][:count] if how == "whole-index" else []
    others: list[Any] = []
    for proc in rng.sample([p for p in nodes if p not in first], len(nodes) - len(first)):
        if len(others) >= count - len(first):
            break
        block_left = [p for p in by_block[int(proc.ready["block"])] if p is not proc and p not in others]
        if block_left:  # only one block index goes entirely: the demo's --min-blocks is depth - 1
            others.append(proc)
    return first + others
