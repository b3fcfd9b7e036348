"""The benchmark report as markdown tables: one small function per table, in the report's order."""

from __future__ import annotations

from typing import Any


def render(r: dict[str, Any]) -> str:
    sections = [_header(r), _vitb(r), _hop(r), _wire(r), _concurrency(r), _coordinator_cost(r), _footer(r)]
    return "\n\n".join("\n".join(lines) for lines in sections)


def _table(title: str, columns: list[str], rows: list[str]) -> list[str]:
    return [title, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns), *rows]


def _header(r: dict[str, Any]) -> list[str]:
    env = r["environment"]
    return [
        f"layerswarm bench{' --quick' if r['quick'] else ''}: {env['date']}, {env['processor']}, {env['cores']} "
        f"cores, Python {env['python']}, torch {env['torch']}, grpcio {env['grpcio']} ({r['seconds']} s)"
    ]


def _vitb(r: dict[str, Any]) -> list[str]:
    v = r["vitb_swarm_vs_monolith"]
    rows = [
        f"| monolith, 1 thread (as each node computes) | {v['monolith_1_thread_ms']} | 1.000 |",
        f"| monolith, 2 threads | {v['monolith_2_threads_ms']} | "
        f"{v['monolith_2_threads_ms'] / v['monolith_1_thread_ms']:.3f} |",
    ]
    for key, value in v.items():
        if key.startswith("swarm_"):
            name = key[len("swarm_") : -len("_ms")]
            rows.append(f"| swarm, {name.replace('_', ' ')} | {value} | {v['ratio_' + name]:.3f} |")
    title = (
        "**ViT-B/16 shape, 12 nodes on loopback, batch 1, end to end** (median of "
        f"{v['reps']}, interleaved with the monolith)"
    )
    return _table(title, ["configuration", "ms", "x monolith (1 thread)"], rows)


def _hop(r: dict[str, Any]) -> list[str]:
    rows = [
        f"| {h['shape']} {h['dtype']} | {h['payload_bytes']} | {h['tcp_floor_ms']} | "
        f"{h['unary_overhead_ms']} | {h['unary_over_floor']} | {h['stream_overhead_ms']} | "
        f"{h['stream_over_floor']} |"
        for h in r["hop_vs_floor"]
    ]
    columns = ["payload", "bytes", "TCP floor ms", "unary ms", "x floor", "stream ms", "x floor"]
    return _table("**One hop against the raw TCP floor** (round trip minus the node's compute time)", columns, rows)


def _wire(r: dict[str, Any]) -> list[str]:
    rows = [
        f"| {w['wire_dtype']} | {w['bytes_per_hop']} | {w['accuracy']} ({w['images']} images) | "
        f"{w['points_lost']} | {w['latency_p50_ms']} |"
        for w in r["wire_formats"]
    ]
    title = "**Wire formats** (shipped family, shuffle policy, same paths for every format)"
    return _table(title, ["wire", "bytes per hop", "accuracy", "points lost", "latency p50 ms"], rows)


def _concurrency(r: dict[str, Any]) -> list[str]:
    rows = [
        f"| {'on' if c['micro_batching'] else 'off'} | {c['concurrency']} | {c['throughput_rps']} | "
        f"{c['throughput_vs_1']} | {c['latency_p50_ms']} | {c['latency_p99_ms']} | {c['statuses']} |"
        for c in r["concurrency"]
    ]
    columns = ["micro-batching", "concurrent", "req/s", "x at 1", "p50 ms", "p99 ms", "statuses"]
    return _table("**Concurrency through HTTP** (shipped family, 16 nodes)", columns, rows)


def _coordinator_cost(r: dict[str, Any]) -> list[str]:
    rows = []
    for name in ("vitb", "shipped"):
        c = r[f"coordinator_cost_{name}"]
        rows.append(
            f"| {name} | {c['coordinator_cpu_ms_per_request']} | {c['nodes_cpu_ms_per_request']} | "
            f"{c['coordinator_share']} |"
        )
    columns = ["swarm", "coordinator ms", "all nodes ms", "coordinator share"]
    return _table("**Coordinator CPU per request** (HTTP end to end, sequential requests)", columns, rows)


def _footer(r: dict[str, Any]) -> list[str]:
    return [
        f"Topologies: star measured; relay {r['topologies']['relay'].split(':')[0]}.",
        f"`vitb_swarm_vs_monolith_ratio` = {r['vitb_swarm_vs_monolith_ratio']}",
    ]
