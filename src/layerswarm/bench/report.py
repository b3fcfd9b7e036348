"""The benchmark report as markdown tables: one small function per table, in the report's order."""

from __future__ import annotations

from typing import Any


def render(r: dict[str, Any]) -> str:
    if "vitb_swarm_vs_monolith" not in r:  # --only adaptive
        sections = [_header(r), render_adaptive(r["adaptive"])]
    else:
        sections = [_header(r), _vitb(r), _hop(r), _wire(r), _concurrency(r), _coordinator_cost(r), _footer(r)]
        if "node_footprint" in r:
            sections.append(_node_footprint(r["node_footprint"]))
        if "adaptive" in r:
            sections.append(render_adaptive(r["adaptive"]))
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


def render_adaptive(a: dict[str, Any]) -> list[str]:
    out = [
        f"**Adaptive compute through the swarm** (one node per block, batch 1, {a['images']} held-out images, "
        "in-process coordinator, fp16 wire)",
        "",
        "| member | default exit | full: acc / blocks / p50 ms | calibrated: acc / blocks / p50 ms | blocks "
        "reduction | points lost | mean latency ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in a["members"].items():
        c, exit_ = m["calibrated_vs_full"], m["policy"]["exit"]
        rule = f"{exit_['rule']} {exit_['threshold']:g}" if exit_ else "none"
        f, k = c["full"], c["calibrated"]
        out.append(
            f"| {name} | {rule} | {f['accuracy']} / {f['mean_blocks']} / {f['latency_p50_ms']} | {k['accuracy']} / "
            f"{k['mean_blocks']} / {k['latency_p50_ms']} | {c['blocks_reduction']}x | {c['points_lost']} | "
            f"{c['latency_mean_ratio']} |"
        )
    out += [
        "",
        f"Adaptive ensembles (up to 2 routes) on the noisy split (noise std {a['noise']}), no early exit:",
        "",
        "| member | single: acc / blocks | adaptive: acc / blocks | threshold | second route | points gained | "
        "hops ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in a["members"].items():
        e = m["ensemble_noisy"]
        out.append(
            f"| {name} | {e['single']['accuracy']} / {e['single']['mean_blocks']} | {e['adaptive']['accuracy']} / "
            f"{e['adaptive']['mean_blocks']} | {e['threshold']:g} | {e['second_route_share']} | "
            f"{e['points_gained']} | {e['hops_ratio']} |"
        )
    out += ["", "Exit curves through the swarm against eval's on the same images (gaps over the threshold sweep):", ""]
    out += ["| member | rule | orders | max accuracy gap | mean accuracy gap | max mean-blocks gap | 2 SE |"]
    out += ["| --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in a["members"].items():
        agree = m["live_vs_eval"]
        for rule, by_orders in agree["rules"].items():
            for orders, g in by_orders.items():
                out.append(
                    f"| {name} | {rule} | {orders.replace('_', ' ')} | {g['max_accuracy_gap']} | "
                    f"{g['mean_accuracy_gap']} | {g['max_blocks_gap']} | {agree['accuracy_2se']} |"
                )
    out += ["", "Anytime answers (deadline = half the full path's p50 latency):", ""]
    out += ["| member | deadline ms | min blocks | answered | accuracy | mean blocks | blocks | p50 / max ms |"]
    out += ["| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in a["members"].items():
        t = m["anytime"]
        out.append(
            f"| {name} | {t['deadline_ms']} | {t['min_blocks']} | {t['answered']}/{t['requests']} | {t['accuracy']} | "
            f"{t['mean_blocks']} | {t['blocks_histogram']} | {t['latency_p50_ms']} / {t['latency_max_ms']} |"
        )
    return out


def _node_footprint(f: dict[str, Any]) -> list[str]:
    node, torch_only = f["node"], f["torch_only_interpreter"]
    rows = [
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
