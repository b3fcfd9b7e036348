"""The benchmark report as markdown tables."""

from __future__ import annotations

from typing import Any


def render(r: dict[str, Any]) -> str:
    env = r["environment"]
    out = [
        f"layerswarm bench{' --quick' if r['quick'] else ''}: {env['date']}, {env['processor']}, {env['cores']} "
        f"cores, Python {env['python']}, torch {env['torch']}, grpcio {env['grpcio']} ({r['seconds']} s)",
        "",
    ]
    v = r["vitb_swarm_vs_monolith"]
    out += [
        "**ViT-B/16 shape, 12 nodes on loopback, batch 1, end to end** (median of "
        f"{v['reps']}, interleaved with the monolith)",
        "",
        "| configuration | ms | x monolith (1 thread) |",
        "| --- | --- | --- |",
        f"| monolith, 1 thread (as each node computes) | {v['monolith_1_thread_ms']} | 1.000 |",
        f"| monolith, 2 threads | {v['monolith_2_threads_ms']} | "
        f"{v['monolith_2_threads_ms'] / v['monolith_1_thread_ms']:.3f} |",
    ]
    for key, value in v.items():
        if key.startswith("swarm_"):
            name = key[len("swarm_") : -len("_ms")]
            out.append(f"| swarm, {name.replace('_', ' ')} | {value} | {v['ratio_' + name]:.3f} |")
    out += [
        "",
        "**One hop against the raw TCP floor** (round trip minus the node's compute time)",
        "",
        "| payload | bytes | TCP floor ms | unary ms | x floor | stream ms | x floor |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for h in r["hop_vs_floor"]:
        out.append(
            f"| {h['shape']} {h['dtype']} | {h['payload_bytes']} | {h['tcp_floor_ms']} | "
            f"{h['unary_overhead_ms']} | {h['unary_over_floor']} | {h['stream_overhead_ms']} | "
            f"{h['stream_over_floor']} |"
        )
    out += [
        "",
        "**Wire formats** (shipped family, shuffle policy, same paths for every format)",
        "",
        "| wire | bytes per hop | accuracy | points lost | latency p50 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for w in r["wire_formats"]:
        out.append(
            f"| {w['wire_dtype']} | {w['bytes_per_hop']} | {w['accuracy']} ({w['images']} images) | "
            f"{w['points_lost']} | {w['latency_p50_ms']} |"
        )
    out += [
        "",
        "**Concurrency through HTTP** (shipped family, 16 nodes)",
        "",
        "| micro-batching | concurrent | req/s | x at 1 | p50 ms | p99 ms | statuses |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in r["concurrency"]:
        out.append(
            f"| {'on' if c['micro_batching'] else 'off'} | {c['concurrency']} | {c['throughput_rps']} | "
            f"{c['throughput_vs_1']} | {c['latency_p50_ms']} | {c['latency_p99_ms']} | {c['statuses']} |"
        )
    out += [
        "",
        "**Coordinator CPU per request** (HTTP end to end, sequential requests)",
        "",
        "| swarm | coordinator ms | all nodes ms | coordinator share |",
        "| --- | --- | --- | --- |",
    ]
    for name in ("vitb", "shipped"):
        c = r[f"coordinator_cost_{name}"]
        out.append(
            f"| {name} | {c['coordinator_cpu_ms_per_request']} | {c['nodes_cpu_ms_per_request']} | "
            f"{c['coordinator_share']} |"
        )
    out += _node_footprint(r["node_footprint"]) if "node_footprint" in r else []
    out += [
        "",
        f"Topologies: star measured; relay {r['topologies']['relay'].split(':')[0]}.",
        f"`vitb_swarm_vs_monolith_ratio` = {r['vitb_swarm_vs_monolith_ratio']}",
    ]
    return "\n".join(out)


def _node_footprint(f: dict[str, Any]) -> list[str]:
    node, torch_only = f["node"], f["torch_only_interpreter"]
    rows = [
        "",
        f"**Node footprint** ({f['block']}, median of {f['reps']}, interleaved with a bare interpreter "
        "that imports torch)",
        "",
        "| process | start s | RSS MiB | anonymous | file-backed (shared) | PSS MiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in (("node", node), ("python + torch only", torch_only)):
        rows.append(
            f"| {name} | {m['start_s']} | {m['rss_mib']} | {m['rss_anon_mib']} | {m['rss_file_mib']} | {m['pss_mib']} |"
        )
    rows += [
        "",
        f"Node RSS x torch-only: {f['node_rss_over_torch_only']}; `layerswarm probe grpc`: {f['probe_s']} s "
        f"({f['probe_over_bare_python']} x a bare `python -c pass`, ok: {f['probe_ok']}).",
    ]
    return rows
