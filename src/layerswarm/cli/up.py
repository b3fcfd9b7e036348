"""`layerswarm up`: a whole swarm on this machine, from the shipped weights, end to end.

Starts nodes from several models of one family (so substitution really happens), a coordinator with
its HTTP server, classifies sample images over HTTP, kills some nodes, and shows that requests still
succeed, with the traces.
"""

from __future__ import annotations

import io
import json
import logging
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from layerswarm.harness.procs import Proc, coordinator_cmd, layerswarm_cmd, spawn, spawn_many, stop_all
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.data import load_dataset
from layerswarm.models.zoo import family_root, robust_members

log = logging.getLogger(__name__)


@dataclass
class UpOptions:
    nodes: int | None = None  # default: two models per block
    requests_per_phase: int = 40
    kill: int | None = None  # default: a third of the nodes
    mdns: bool = True
    family_dir: Path | None = None
    seed: int = 0
    timeout_s: float = 60.0


@dataclass
class Phase:
    name: str
    results: list[dict[str, Any]] = field(default_factory=list)

    def tally(self) -> dict[str, Any]:
        ok = [r for r in self.results if r["status"] == 200]
        return {
            "requests": len(self.results),
            "succeeded": len(ok),
            "failed": len(self.results) - len(ok),
            "accuracy": round(sum(r["correct"] for r in ok) / len(ok), 4) if ok else 0.0,
            "substituted_hops": sum(r.get("substituted", 0) for r in ok),
            "skipped_hops": sum(r.get("skipped", 0) for r in ok),
        }


def node_layout(members: list[Path], depth: int, count: int) -> list[tuple[Path, int]]:
    """Node k serves block k % depth of member (k // depth) % len(members): every block from the first
    model, then every block again from the next, so several models of the family stand behind each index."""
    return [(members[(k // depth) % len(members)], k % depth) for k in range(count)]


def start_swarm(opts: UpOptions) -> tuple[list[Proc], Proc, list[Path]]:
    root = opts.family_dir or family_root()
    members = robust_members(root)
    depth = read_manifest(members[0]).config.depth
    count = opts.nodes or depth * min(2, len(members))
    specs = []
    for i, (model_dir, block) in enumerate(node_layout(members, depth, count)):
        args = ["node", "--model-dir", str(model_dir), "--block", str(block), "--host", "127.0.0.1", "--port", "0"]
        specs.append((f"node-{i}", layerswarm_cmd(*args, *([] if opts.mdns else ["--no-advertise"]))))
    nodes = spawn_many(specs, opts.timeout_s * 2)
    try:
        family = [f"--family-dir={m}" for m in members[1:]]
        # The demo kills every node of one block index to show a degraded answer, so it accepts one block
        # fewer than the evaluated minimum depth a coordinator defaults to (manifest policy).
        degraded = ["--min-blocks", str(depth - 1)]
        cmd = coordinator_cmd(members[0], None if opts.mdns else nodes, "--health-interval", "0.5", *family, *degraded)
        coordinator = spawn("coordinator", cmd, opts.timeout_s)
    except Exception:
        stop_all(nodes)
        raise
    return nodes, coordinator, members


def wait_for_swarm(client: httpx.Client, expected: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        view = client.get("/v1/nodes").json()
        if sum(n["state"] == "healthy" for n in view["nodes"]) >= expected:
            return view
        time.sleep(0.2)
    raise TimeoutError(
        f"only {sum(n['state'] == 'healthy' for n in view.get('nodes', []))} of {expected} nodes "
        f"became healthy in {timeout_s:.0f} s"
    )


def png_bytes(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray((image.transpose(1, 2, 0) * 255).round().astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def classify_many(client: httpx.Client, phase: Phase, samples: list[tuple[bytes, str]], rng: random.Random) -> None:
    for image, label in samples:
        reply = client.post(
            "/v1/classify", files={"file": ("x.png", image, "image/png")}, data={"seed": str(rng.randrange(2**31))}
        )
        body = reply.json()
        row: dict[str, Any] = {"status": reply.status_code, "label": label}
        if reply.status_code == 200:
            row.update(
                correct=body["prediction"] == label,
                prediction=body["prediction"],
                depth=body["depth"],
                substituted=body["trace"]["substituted"],
                skipped=body["trace"]["skipped"],
                trace=body["trace"],
            )
        else:
            row.update(correct=False, error=body)
        phase.results.append(row)


def run_up(opts: UpOptions) -> dict[str, Any]:
    rng = random.Random(opts.seed)
    nodes, coordinator, members = start_swarm(opts)
    try:
        manifest = read_manifest(members[0])
        data = load_dataset(manifest.dataset["spec"], seed=int(manifest.dataset.get("data_seed", 0)))
        picks = rng.sample(range(len(data.test_y)), 2 * opts.requests_per_phase)
        samples = [(png_bytes(data.test_x[i].numpy()), data.class_names[int(data.test_y[i])]) for i in picks]
        base = f"http://127.0.0.1:{coordinator.ready['port']}"
        with httpx.Client(base_url=base, timeout=30.0) as client:
            wait_for_swarm(client, len(nodes), opts.timeout_s)
            before = Phase("all nodes up")
            classify_many(client, before, samples[: opts.requests_per_phase], rng)
            killed = choose_victims(nodes, opts.kill if opts.kill is not None else len(nodes) // 3, rng)
            for proc in killed:
                proc.signal(signal.SIGKILL)
            after = Phase(f"{len(killed)} nodes killed")
            classify_many(client, after, samples[opts.requests_per_phase :], rng)
            view = client.get("/v1/nodes").json()
        return summarise([before, after], nodes, killed, view)
    finally:
        stop_all([coordinator, *nodes])


def choose_victims(nodes: list[Proc], count: int, rng: random.Random) -> list[Proc]:
    """Kill every node of one block index (forcing a cross-block substitution or a skip) plus random
    others, leaving every other index at least one node."""
    if count <= 0:
        return []
    by_block: dict[int, list[Proc]] = {}
    for proc in nodes:
        by_block.setdefault(int(proc.ready["block"]), []).append(proc)
    first = by_block[rng.choice(sorted(by_block))][:count]
    others: list[Proc] = []
    for proc in rng.sample([p for p in nodes if p not in first], len(nodes) - len(first)):
        if len(others) >= count - len(first):
            break
        block_left = [p for p in by_block[int(proc.ready["block"])] if p is not proc and p not in others]
        if block_left:  # only one block index goes entirely: the demo's --min-blocks is depth - 1
            others.append(proc)
    return first + others


def summarise(phases: list[Phase], nodes: list[Proc], killed: list[Proc], view: dict[str, Any]) -> dict[str, Any]:
    rows = [r for p in phases for r in p.results]
    total = Phase("total", rows).tally()
    example = next((r["trace"] for r in phases[-1].results if r.get("substituted") or r.get("skipped")), None)
    return {
        **total,
        "nodes_started": len(nodes),
        "nodes_killed": len(killed),
        "killed": [{"pid": p.pid, "block": p.ready["block"], "model_id": p.ready["model_id"]} for p in killed],
        "phases": {p.name: p.tally() for p in phases},
        "swarm_after": {
            "reachable_depth": view.get("reachable_depth"),
            "states": _counts(n["state"] for n in view.get("nodes", [])),
        },
        "example_trace": example,
    }


def render(summary: dict[str, Any]) -> str:
    lines = [f"layerswarm up: {summary['nodes_started']} nodes started, {summary['nodes_killed']} killed (SIGKILL)", ""]
    lines.append(f"{'phase':<22}{'requests':>9}{'ok':>6}{'failed':>8}{'accuracy':>10}{'substituted':>13}{'skipped':>9}")
    for name, t in summary["phases"].items():
        lines.append(
            f"{name:<22}{t['requests']:>9}{t['succeeded']:>6}{t['failed']:>8}{t['accuracy']:>10.3f}"
            f"{t['substituted_hops']:>13}{t['skipped_hops']:>9}"
        )
    lines.append(
        f"{'total':<22}{summary['requests']:>9}{summary['succeeded']:>6}{summary['failed']:>8}"
        f"{summary['accuracy']:>10.3f}{summary['substituted_hops']:>13}{summary['skipped_hops']:>9}"
    )
    trace = summary.get("example_trace")
    if trace:
        lines += ["", "one request after the kills (position: block @ node [model] outcome):"]
        lines += [_render_hop(hop) for hop in trace["hops"]]
    lines.append("")
    lines.append(f"swarm after: {summary['swarm_after']}")
    return "\n".join(lines)


def to_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2)


def _render_hop(hop: dict[str, Any]) -> str:
    failed = "; ".join(f"{a['node']} {a['error'].split(':')[0]}" for a in hop["attempts"])
    failed = f"  (failed: {failed})" if failed else ""
    if hop["block"] is None:
        return f"  -: planned block {hop['planned_block']} skipped, no node could stand in{failed}"
    model = (hop["model_id"] or "")[-8:]
    return f"  {hop['position']}: block {hop['block']} @ {hop['node']} [{model}] {hop['outcome']}{failed}"


def _counts(values: Any) -> dict[str, int]:
    return dict(Counter(values))
