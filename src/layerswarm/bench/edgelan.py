"""The emulated edge LAN: star vs relay chains against the physical lower bound, and network-aware
order against a random one on a mixed LAN (docs/relay.md).

    python -m layerswarm.bench.edgelan [--quick] [--json out.json] [--markdown out.md]

One network namespace per host on a bridge (harness/netlab.py), every host link shaped with tc tbf in
both directions (harness/shaping.py) and checked with a raw TCP transfer. The coordinator runs in this
process, on the bridge. Needs root; re-executes itself in a private network namespace (nothing here
touches a real interface).

Bound: the one-thread compute of stem + every block + head (measured here, interleaved with the swarm
requests) plus (blocks + 1) activation transfers at the nominal link rate.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from layerswarm.coordinator import CHOICES, ClassifyOptions, Coordinator, CoordinatorSettings, Policy
from layerswarm.coordinator.routing.topology import MIN_SAMPLES
from layerswarm.harness.netlab import Host, NetLab
from layerswarm.harness.netns import bench_in_private_netns, in_private_netns
from layerswarm.harness.procs import Proc, node_address, node_cmd, spawn_many, stop_all
from layerswarm.harness.shaping import measure_mbps, shape, slow_start_after_idle
from layerswarm.models.checkpoint import Lineage, load_model, save_model
from layerswarm.models.config import ViTConfig
from layerswarm.models.vit import ViT

from . import emit_table
from .fixtures import VITB, median_ms
from .machine import environment
from .trace_cost import trace_signature_cost

log = logging.getLogger(__name__)
TOKEN = "edge-lan-bench-token"


def model_dir(root: Path, depth: int) -> Path:
    """ViT-B/16's width and tokens, `depth` blocks, random weights (time is measured, not accuracy)."""
    torch.manual_seed(0)
    out = root / f"vitb16-depth{depth}"
    save_model(
        ViT(ViTConfig(**{**VITB, "depth": depth}, variant="layershuffle", pos_embed_init_std=0.02)), out, Lineage()
    )
    return out


def start_nodes(
    hosts: list[Host], placement: list[int], model: Path, token_file: Path, *extra: str, name: str = "lan-node"
) -> list[Proc]:
    """Block b on hosts[placement[b]]: each node process inside its host's namespace."""
    specs = []
    for block, h in enumerate(placement):
        host = hosts[h]
        cmd = node_cmd(
            model, block, "--no-advertise", "--grace", "0.2", "--token-file", str(token_file), *extra, host=host.address
        )
        specs.append((f"{name}-{block}", host.command(cmd)))
    return spawn_many(specs, timeout=300)


WIRES = ("fp16", "int8", "auto")  # auto: int8 or fp16 per link, from measured link costs
PER_CALL = "relay_per_call_fp16"  # relay chains whose nodes forward with a Relay call per chain
AUTO_TOPOLOGY = "auto_topology_fp16"  # the default --topology auto: star or relay per request, as measured


def wires() -> list[str]:
    return [w for w in WIRES if w in CHOICES["wire_dtype"]]


def coordinator(model: Path, procs: list[Proc], token_file: Path, topology: str, wire: str = "fp16") -> Coordinator:
    settings = CoordinatorSettings(
        model_dir=model,
        peers=tuple(node_address(p) for p in procs),
        mdns=False,
        wire_dtype=wire,
        topology=topology,
        token_file=token_file,
        hop_timeout_s=60,
        request_timeout_s=300,
        health_interval_s=30,
        verify_rate=None,  # off for both topologies: re-execution would add coordinator compute to both
        exit_rule="none",
        hedge_quantile=None,
    )
    return Coordinator(settings)


class Monolith:
    """The bound's compute: stem, every block and head in this process, one thread."""

    def __init__(self, model: Path) -> None:
        self.model, _ = load_model(model)
        self.images = torch.rand(1, 3, 224, 224)

    def seconds(self) -> float:
        with torch.inference_mode():
            started = time.perf_counter()
            self.model(self.images)
            return time.perf_counter() - started


Samples = dict[str, list[float]]
Plans = dict[str, list[dict[str, Any]]]


async def interleaved(
    runs: dict[str, tuple[Coordinator, ClassifyOptions]], monolith: Monolith, reps: int, depth: int
) -> tuple[Samples, Plans]:
    """Every configuration once per round, in a rotating order; two warm-up rounds."""
    images = monolith.images
    samples: dict[str, list[float]] = {"compute": [], **{k: [] for k in runs}}
    names = list(samples)
    extras: dict[str, list[dict[str, Any]]] = {k: [] for k in runs}
    for rep in range(reps + 2):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            if name == "compute":
                elapsed = monolith.seconds()
            else:
                coord, opts = runs[name]
                opts = ClassifyOptions(policy=opts.policy, seed=random.randrange(2**31), exit_rule="none")
                started = time.perf_counter()
                result = await coord.router.classify(images, opts)
                elapsed = time.perf_counter() - started
                if result.path.depth != depth:
                    raise RuntimeError(f"{name}: only {result.path.depth} of {depth} blocks ran")
                if rep >= 2 and result.path.network is not None:
                    extras[name].append(dict(result.path.network))
                if rep >= 2 and name.endswith("_auto"):  # what auto chose, hop by hop
                    extras[name].append({"wires": sorted({str(h.wire) for h in result.path.hops})})
                if rep >= 2 and name == AUTO_TOPOLOGY:  # which topology auto ran this request on
                    extras[name].append({"topology": result.path.topology})
                if rep >= 2 and name.startswith("relay_"):
                    extras[name].append(_relay_split(result.path.hops, elapsed))
            if rep >= 2:
                samples[name].append(elapsed)
    return samples, extras


async def settle_auto(coord: Coordinator, images: torch.Tensor) -> None:
    """auto's first requests try each topology MIN_SAMPLES times: run them before measuring, so the figure
    is the steady state of a swarm that has served a few requests (its 5% exploration included)."""
    opts = ClassifyOptions(policy=Policy.SEQUENTIAL, exit_rule="none")
    for _ in range(2 * MIN_SAMPLES):
        await coord.router.classify(images, opts)


def _relay_split(hops: list[Any], elapsed_s: float) -> dict[str, float]:
    """Where a relayed request's time went, from its trace: the nodes' compute, the forwarding between
    them (wire time included; until the next node's acknowledgement, less its compute), and the rest
    (the coordinator's stem, head and two legs, the trace's way back, each node's handling)."""
    relayed = [h for h in hops if h.outcome == "relayed"]
    forwarding = sum(h.send_ms or 0.0 for h in relayed)
    compute = sum(h.latency_ms for h in relayed) - forwarding
    return {"nodes_compute_ms": compute, "forwarding_ms": forwarding, "rest_ms": elapsed_s * 1e3 - compute - forwarding}


async def uniform(
    root: Path, model: Path, depth: int, token_file: Path, rates: list[int], reps: int
) -> list[dict[str, Any]]:
    """One node per host, every link at the same rate: star vs relay vs the bound."""
    monolith = Monolith(model)
    nbytes = 197 * 768 * 2  # one fp16 activation at batch 1
    rows = []
    with NetLab() as lab:
        hosts = [lab.add_host(f"h{i}") for i in range(depth)]
        procs = start_nodes(hosts, list(range(depth)), model, token_file)
        # The same nodes forwarding with a Relay call per chain: what the long-lived streams save.
        per_call = start_nodes(
            hosts, list(range(depth)), model, token_file, "--no-relay-streams", name="lan-node-per-call"
        )
        try:
            for restart, mbit in itertools.product((True, False), rates):
                for host in hosts:
                    shape(host, mbit)
                    slow_start_after_idle(restart, host)
                slow_start_after_idle(restart)  # the coordinator's side (this private namespace)
                tcp = measure_mbps(hosts[0], 4_000_000 if mbit <= 100 else 20_000_000)
                coords = {
                    f"{t}_{w}": coordinator(model, procs, token_file, t, w) for t in ("star", "relay") for w in wires()
                }
                coords[PER_CALL] = coordinator(model, per_call, token_file, "relay", "fp16")
                coords[AUTO_TOPOLOGY] = coordinator(model, procs, token_file, "auto", "fp16")
                for c in coords.values():
                    await c.start()
                    await c.watch.wait_first_round(30)
                try:
                    seq = ClassifyOptions(policy=Policy.SEQUENTIAL)
                    await settle_auto(coords[AUTO_TOPOLOGY], monolith.images)
                    runs = {name: (c, seq) for name, c in coords.items()}
                    samples, extras = await interleaved(runs, monolith, reps, depth)
                finally:
                    for c in coords.values():
                        await c.stop()
                row = _uniform_row(mbit, tcp, nbytes, depth, samples)
                for name, seen in extras.items():
                    if name == AUTO_TOPOLOGY:  # after the warm-up rounds: exploration included
                        relayed = sum(e["topology"] == "relay" for e in seen)
                        row[f"{name}_relay_share"] = round(relayed / len(seen), 3) if seen else None
                    if name.endswith("_auto"):
                        row[f"{name}_chose"] = sorted({w for e in seen for w in e.get("wires", [])})
                    if name in ("relay_fp16", PER_CALL):
                        for part in ("nodes_compute_ms", "forwarding_ms", "rest_ms"):
                            row[f"{name}_{part}"] = median_ms([e[part] / 1e3 for e in seen if part in e])
                rows.append({"tcp_slow_start_after_idle": restart, **row})
        finally:
            stop_all(procs + per_call)
    return rows


def _uniform_row(mbit: int, tcp: float, nbytes: int, depth: int, samples: Samples) -> dict[str, Any]:
    compute = median_ms(samples["compute"])
    transfers = depth + 1
    bound = compute + transfers * nbytes * 8 / (mbit * 1e3)
    bound_tcp = compute + transfers * nbytes * 8 / (tcp * 1e3)
    row: dict[str, Any] = {
        "link_mbit": mbit,
        "raw_tcp_mbit": round(tcp, 1),
        "activation_bytes": nbytes,
        "compute_ms": compute,
        "bound_ms": round(bound, 3),
        "bound_at_raw_tcp_ms": round(bound_tcp, 3),
        "reps": len(samples["compute"]),
    }
    for name in (*(f"{t}_{w}" for t in ("star", "relay") for w in wires()), PER_CALL, AUTO_TOPOLOGY):
        row[f"{name}_ms"] = median_ms(samples[name])
        row[f"{name}_over_bound"] = round(row[f"{name}_ms"] / bound, 3)
    row["relay_per_call_over_streams"] = round(row[f"{PER_CALL}_ms"] / row["relay_fp16_ms"], 3)
    return row


async def mixed(root: Path, model: Path, depth: int, token_file: Path, hosts_n: int, reps: int) -> dict[str, Any]:
    """Several nodes per host, blocks interleaved over hosts; half the hosts' links 10x slower.
    Relay chains in a random order (shuffle) against the network-aware order."""
    monolith = Monolith(model)
    fast, slow = 100, 10
    with NetLab() as lab:
        hosts = [lab.add_host(f"m{i}") for i in range(hosts_n)]
        rates = [fast if i < hosts_n // 2 else slow for i in range(hosts_n)]
        for host, mbit in zip(hosts, rates, strict=True):
            shape(host, mbit)
        procs = start_nodes(hosts, [b % hosts_n for b in range(depth)], model, token_file)
        try:
            coord = coordinator(model, procs, token_file, "relay")
            await coord.start()
            await coord.watch.wait_first_round(30)
            try:
                runs = {
                    "random_order": (coord, ClassifyOptions(policy=Policy.SHUFFLE)),
                    "network_order": (coord, ClassifyOptions(policy=Policy.NETWORK)),
                }
                samples, all_plans = await interleaved(runs, monolith, reps, depth)
                links = {a: coord.registry.links.from_node(a) for a in coord.registry.nodes}
            finally:
                await coord.stop()
        finally:
            stop_all(procs)
    plans = all_plans["network_order"]
    result: dict[str, Any] = {
        "hosts": hosts_n,
        "host_link_mbit": rates,
        "nodes_per_host": depth // hosts_n,
        "random_order_ms": median_ms(samples["random_order"]),
        "network_order_ms": median_ms(samples["network_order"]),
        "compute_ms": median_ms(samples["compute"]),
        "reps": len(samples["compute"]),
        "network_predicted_ms": round(sorted(p["predicted_ms"] for p in plans)[len(plans) // 2], 3) if plans else None,
        "network_actual_ms": round(sorted(p["actual_ms"] for p in plans)[len(plans) // 2], 3) if plans else None,
        "network_plan_example": plans[-1] if plans else None,
        "links_measured": sum(len(v) for v in links.values()),
    }
    result["random_over_network"] = round(result["random_order_ms"] / result["network_order_ms"], 3)
    return result


async def run_here(quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    depth = 4 if quick else 12
    reps = 3 if quick else 10
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="layerswarm-edgelan-") as tmp:
        root = Path(tmp)
        token_file = root / "token"
        token_file.write_text(TOKEN + "\n")
        model = model_dir(root, depth)
        report: dict[str, Any] = {
            "quick": quick,
            "blocks": depth,
            "shaping": "tc tbf, both directions of every host link",
        }
        report["uniform"] = await uniform(root, model, depth, token_file, [100, 1000], reps)
        report["mixed"] = await mixed(root, model, depth, token_file, 2 if quick else 4, reps)
    report["trace_signatures"] = trace_signature_cost()  # included in every relay figure above
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def run(quick: bool) -> dict[str, Any]:
    """The benchmark, in a private network namespace (re-executed there when this one is not)."""
    if in_private_netns():
        return asyncio.run(run_here(quick))
    return bench_in_private_netns("layerswarm.bench.edgelan", quick)


def render(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"Edge LAN: skipped ({r['skipped']})"
    lines = [
        f"Edge LAN ({r['blocks']} ViT-B/16-shaped blocks, batch 1, {r['shaping']}; bound: fp16 transfers; "
        f"{r['seconds']} s)",
        "",
        "| link | TCP slow start after idle | wire | raw TCP Mbit/s | compute ms | bound ms | star ms "
        "| star / bound | relay ms | relay / bound |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for u in r["uniform"]:
        for w in (w for w in WIRES if f"star_{w}_ms" in u):
            chose = u.get(f"star_{w}_chose")
            label = f"{w} (star: {'/'.join(chose)}; relay: {'/'.join(u.get(f'relay_{w}_chose', []))})" if chose else w
            lines.append(
                f"| {u['link_mbit']} Mbit/s | {'on (default)' if u['tcp_slow_start_after_idle'] else 'off'} | {label} "
                f"| {u['raw_tcp_mbit']} | {u['compute_ms']} | {u['bound_ms']} | {u[f'star_{w}_ms']} "
                f"| {u[f'star_{w}_over_bound']} | {u[f'relay_{w}_ms']} | {u[f'relay_{w}_over_bound']} |"
            )
    lines += [
        "",
        "Relay chains (fp16) whose nodes forward over one long-lived stream per next node (the default) or "
        "with a Relay call per chain (`--no-relay-streams`):",
        "",
        "| link | TCP slow start after idle | streams / bound | a call per chain / bound | per call / streams "
        "| streams: nodes' compute / forwarding / rest ms | per call: the same |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for u in (u for u in r["uniform"] if f"{PER_CALL}_ms" in u):
        split = {
            name: " / ".join(str(u.get(f"{name}_{part}")) for part in ("nodes_compute_ms", "forwarding_ms", "rest_ms"))
            for name in ("relay_fp16", PER_CALL)
        }
        lines.append(
            f"| {u['link_mbit']} Mbit/s | {'on (default)' if u['tcp_slow_start_after_idle'] else 'off'} "
            f"| {u['relay_fp16_over_bound']} | {u[f'{PER_CALL}_over_bound']} | {u['relay_per_call_over_streams']} "
            f"| {split['relay_fp16']} | {split[PER_CALL]} |"
        )
    lines += [
        "",
        "`--topology auto` (the default; fp16): star or relay per request, whichever has measured faster per hop:",
        "",
        "| link | TCP slow start after idle | auto / bound | star / bound | relay / bound | share run as relay |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for u in (u for u in r["uniform"] if f"{AUTO_TOPOLOGY}_ms" in u):
        lines.append(
            f"| {u['link_mbit']} Mbit/s | {'on (default)' if u['tcp_slow_start_after_idle'] else 'off'} "
            f"| {u[f'{AUTO_TOPOLOGY}_over_bound']} | {u['star_fp16_over_bound']} | {u['relay_fp16_over_bound']} "
            f"| {u.get(f'{AUTO_TOPOLOGY}_relay_share')} |"
        )
    m = r["mixed"]
    lines += [
        "",
        f"Mixed LAN: {m['hosts']} hosts x {m['nodes_per_host']} nodes, host links {m['host_link_mbit']} Mbit/s, "
        "relay chains",
        "",
        "| order | ms | random / network |",
        "| --- | --- | --- |",
        f"| random (shuffle) | {m['random_order_ms']} | {m['random_over_network']} |",
        f"| network-aware (predicted {m['network_predicted_ms']}, actual {m['network_actual_ms']}) | "
        f"{m['network_order_ms']} | 1.000 |",
    ]
    if "trace_signatures" in r:
        t = r["trace_signatures"]
        lines += [
            "",
            f"Signed trace entries, per relayed hop: a node signs in {t['sign_us']} us, the coordinator "
            f"checks in {t['check_us']} us (median of {t['reps']}).",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 blocks, 3 requests per configuration")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    report = {"environment": environment(), **run(args.quick)}
    return emit_table(report, render(report), args.json, args.markdown)


if __name__ == "__main__":
    raise SystemExit(main())
