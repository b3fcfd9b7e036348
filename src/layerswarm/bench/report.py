"""The benchmark report as markdown tables: one small function per table, in the report's order."""

from __future__ import annotations

from typing import Any

from .edgelan import render as render_edge_lan
from .generation_modes import render as render_generation_modes
from .grpc_echo import HOP_PARTS
from .loadbalancer import render as render_load_balancer


def render(r: dict[str, Any]) -> str:
    """Every table whose figures the report holds, in order (`--only` runs hold a subset)."""
    tables = [
        ("vitb_swarm_vs_monolith", _vitb),
        ("vitb_throughput", _throughput),
        ("process_ring", _process_ring),
        ("hop_vs_floor", _hop),
        ("wire_formats", _wire),
        ("activation_forms", _activation_forms),
        ("concurrency", _concurrency),
        ("coordinator_cost_vitb", _coordinator_cost),
        ("vitb_swarm_vs_monolith_ratio", _footer),
        ("node_footprint", lambda r: _node_footprint(r["node_footprint"])),
        ("decode_node", lambda r: _decode_node(r["decode_node"])),
        ("generation", lambda r: _generation(r["generation"])),
        ("generation_modes", lambda r: render_generation_modes(r["generation_modes"])),
        ("load_balancer", lambda r: render_load_balancer(r["load_balancer"])),
        ("adaptive", lambda r: render_adaptive(r["adaptive"])),
        ("exit_default", lambda r: render_exit_default(r["exit_default"])),
        ("anytime_default", lambda r: render_anytime_default(r["anytime_default"])),
        ("edge_lan", lambda r: [render_edge_lan(r["edge_lan"])]),
        ("cuda", _cuda),
    ]
    sections = [_header(r)] + [table(r) for key, table in tables if key in r]
    return "\n\n".join("\n".join(lines) for lines in sections)


def _throughput(r: dict[str, Any]) -> list[str]:
    t = r["vitb_throughput"]
    cpu = f"nodes {t['swarm_nodes_cpu_s']} + coordinator {t['swarm_coordinator_cpu_s']} CPU-s"
    cpu += f"; {t['swarm_cores_busy']} cores busy"
    rows = [_row(f"swarm, {t['concurrent']} concurrent batch-1 requests", t["swarm_images_per_s"], t["ratio"], cpu)]
    variants = [
        ("vitb_throughput_blocking_checks", "swarm, the same, spot checks blocking"),
        ("vitb_throughput_relay", "swarm, the same, relay chains"),
        ("vitb_throughput_no_spot_checks", "swarm, the same, no spot checks"),
    ]
    for key, label in variants:  # each its own rounds, against the monolith interleaved with them
        if key in r:
            v = r[key]
            v_cpu = f"nodes {v['swarm_nodes_cpu_s']} + coordinator {v['swarm_coordinator_cpu_s']} CPU-s"
            rows.append(
                _row(label, v["swarm_images_per_s"], v["ratio"], f"{v_cpu}; {v['swarm_cores_busy']} cores busy")
            )
    rows.append(
        _row(f"monolith, 2 threads, batch {t['concurrent']}", t["monolith_2_threads_images_per_s"], "1.000", "-")
    )
    title = f"**ViT-B/16 shape, 12 nodes: throughput** (median of {t['rounds']} rounds, interleaved)"
    lines = _table(title, ["configuration", "images/s", "x monolith (2 threads)", "per round"], rows)
    if "vitb_idle_vs_busy" in r:
        i = r["vitb_idle_vs_busy"]
        lines += [
            "",
            f"A block's compute in a node (its own timer): {i['block_in_turn_ms']} ms called in turn with "
            f"the other nodes, {i['block_back_to_back_ms']} ms called back to back.",
        ]
    return lines


def _cuda(r: dict[str, Any]) -> list[str]:
    """The same tables with CUDA nodes; every monolith row there ran on the same GPU (its "threads" are
    the CPU threads that launch its kernels)."""
    c = r["cuda"]
    lines = [f"**With CUDA nodes: 12 node processes on one {c['device']}, the monolith on the same GPU**"]
    for table in (_vitb, _throughput, _hop):
        lines += ["", *table(c)]
    return lines


def _table(title: str, columns: list[str], rows: list[str]) -> list[str]:
    return [title, "", _row(*columns), "|" + " --- |" * len(columns), *rows]


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _cells(d: dict[str, Any], *keys: str) -> list[Any]:
    return [d[k] for k in keys]


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
    if "blocks_1_thread_ms" in v:
        rows.append(f"| monolith's 12 blocks alone, 1 thread | {v['blocks_1_thread_ms']} | - |")
        rows.append(f"| the nodes' own compute, summed (their Info) | {v['nodes_compute_ms']} | - |")
    for key, value in v.items():
        if key.startswith("swarm_"):
            name = key[len("swarm_") : -len("_ms")]
            rows.append(f"| swarm, {name.replace('_', ' ')} | {value} | {v['ratio_' + name]:.3f} |")
    title = (
        "**ViT-B/16 shape, 12 nodes on loopback, batch 1, end to end** (median of "
        f"{v['reps']}, interleaved with the monolith)"
    )
    return _table(title, ["configuration", "ms", "x monolith (1 thread)"], rows)


def _process_ring(r: dict[str, Any]) -> list[str]:
    p = r["process_ring"]
    rows = [
        f"| one process, every block back to back (the monolith's loop) | {p['monolith_blocks_ms']} | 1.000 |",
        f"| a process per block, as the activation arrives | {p['ring_first_ms']} | {p['ring_first_over_monolith']} |",
        f"| a process per block, the same block again at once | {p['ring_again_ms']} "
        f"| {p['ring_again_over_monolith']} |",
    ]
    title = (
        f"**A process per block with no network** ({p['blocks']} ViT-B/16 blocks, batch 1, a ring of processes "
        f"over pipes; blocks' compute summed, median of {p['reps']}, interleaved)"
    )
    return _table(title, ["where each block runs", "ms", "x one process"], rows)


def _hop(r: dict[str, Any]) -> list[str]:
    rows = []
    for h in r["hop_vs_floor"]:
        cells = [h["payload_bytes"], h["tcp_floor_ms"]]
        for t in ("unary", "stream"):
            cells += [h.get(f"grpc_echo_{t}_ms", "-"), h[f"{t}_overhead_ms"], h[f"{t}_over_floor"]]
            cells += [h.get(f"{t}_over_grpc_echo", "-")]
        rows.append(_row(f"{h['shape']} {h['dtype']}", *cells))
    columns = ["payload", "bytes", "TCP floor ms"]
    columns += [c for t in ("unary", "stream") for c in (f"gRPC echo {t} ms", f"{t} hop ms", "x floor", "x echo")]
    title = (
        "**One hop against a bare gRPC echo and the raw TCP floor** (hop: round trip minus the node's "
        "compute time; echo: the same bytes through grpc.aio with no protobuf, codec or compute)"
    )
    return [*_table(title, columns, rows), "", *_hop_parts(r)]


def _hop_parts(r: dict[str, Any]) -> list[str]:
    rows = []
    for h in r["hop_vs_floor"]:
        if "stream_parts_ms" in h:
            share = [h["stream_parts_ms"][p] for p in HOP_PARTS]
            rows.append(_row(f"{h['shape']} {h['dtype']}", h["grpc_echo_stream_ms"], *share, h["stream_overhead_ms"]))
    columns = ["payload", "gRPC echo ms", "+ protobuf", "+ codec and checks", "+ thread hand-off", "+ rest of node"]
    title = (
        "**Where a streamed hop's time goes** (ms; each column is the difference between two rungs of the "
        "echo server, bench/grpc_echo.py, measured interleaved with the hop)"
    )
    return _table(title, [*columns, "= hop ms"], rows)


def _activation_forms(r: dict[str, Any]) -> list[str]:
    keys = ["activation_shape", "hops", "int8_rel_rms_mean", "int8_rel_rms_worst_hop"]
    keys += ["int8_worst_error_over_row_peak", "int8_codec_ms_per_hop", "zlib_ratio", "zlib_cpu_ms_per_hop"]
    keys += ["net_saving_ms_per_hop_100mbit", "net_saving_ms_per_hop_1000mbit"]
    rows = [_row(a["model"], *_cells(a, *keys)) for a in r.get("activation_forms", [])]
    columns = ["model", "activation", "hops", "int8 rel. RMS", "worst hop", "worst / row peak", "int8 codec ms/hop"]
    columns += ["zlib ratio (fp16)"]
    columns += ["zlib ms/hop", "net ms saved/hop 100 Mbit", "net ms saved/hop 1 Gbit"]
    title = "**Compact forms on real activations** (int8 error against float32; zlib level 1 on the fp16 bytes)"
    table = _table(title, columns, rows)
    accuracy = [
        _row(a["order"], a["wire_dtype"], a["accuracy"], a["points_lost"], a["images"])
        for a in r.get("wire_accuracy_in_process", [])
    ]
    title = "**Wire dtype and accuracy, in one process** (shipped family, every hop rounded as the swarm does)"
    return [*table, "", *_table(title, ["order", "wire", "accuracy", "points lost", "images"], accuracy)]


def _wire(r: dict[str, Any]) -> list[str]:
    rows = [
        _row(
            w["wire_dtype"],
            w["bytes_per_hop"],
            f"{w['accuracy']} ({w['images']} images)",
            w["points_lost"],
            w["latency_p50_ms"],
        )
        for w in r["wire_formats"]
    ]
    title = "**Wire formats** (shipped family, shuffle policy, same paths for every format)"
    return _table(title, ["wire", "bytes per hop", "accuracy", "points lost", "latency p50 ms"], rows)


def _concurrency(r: dict[str, Any]) -> list[str]:
    keys = ("concurrency", "throughput_rps", "throughput_vs_1", "latency_p50_ms", "latency_p99_ms", "statuses")
    rows = [_row("on" if c["micro_batching"] else "off", *_cells(c, *keys)) for c in r["concurrency"]]
    columns = ["micro-batching", "concurrent", "req/s", "x at 1", "p50 ms", "p99 ms", "statuses"]
    return _table("**Concurrency through HTTP** (shipped family, 16 nodes)", columns, rows)


def _coordinator_cost(r: dict[str, Any]) -> list[str]:
    keys = ("coordinator_cpu_ms_per_request", "nodes_cpu_ms_per_request", "coordinator_share")
    names = [name for name in ("vitb", "shipped") if f"coordinator_cost_{name}" in r]
    rows = [_row(name, *_cells(r[f"coordinator_cost_{name}"], *keys)) for name in names]
    columns = ["swarm", "coordinator ms", "all nodes ms", "coordinator share"]
    return _table("**Coordinator CPU per request** (HTTP end to end, sequential requests)", columns, rows)


def _footer(r: dict[str, Any]) -> list[str]:
    return [
        "Topologies: star above (loopback); star vs relay chains on a shaped LAN: Edge LAN below.",
        f"`vitb_swarm_vs_monolith_ratio` = {r['vitb_swarm_vs_monolith_ratio']}",
    ]


def render_adaptive(a: dict[str, Any]) -> list[str]:
    members = a["members"]
    tables = [_calibrated(a, members), _ensembles(a, members), _live_vs_eval(members), _anytime(members)]
    return [line for i, table in enumerate(tables) for line in ([""] if i else []) + table]


def render_anytime_default(a: dict[str, Any]) -> list[str]:
    """Accuracy against the deadline: each shipped family, default options, only deadline_ms set."""
    rows = []
    for name, f in a["families"].items():
        floor = f["depth_rule"]["anytime_min_blocks"]
        for c in f["curve"]:
            cells = _cells(c, "accuracy", "mean_blocks", "cut_by_deadline", "exited_early", "within_deadline")
            rows.append(_row(f"{name} (floor {floor})", _deadline(c), *cells))
    title = (
        f"**Anytime answers with default options** ({a['requests']} held-out requests a deadline, batch 1; "
        "deadlines as a fraction of the full path's p50 measured in the same run)"
    )
    columns = ["family (anytime floor)", "deadline", "accuracy", "mean blocks", "cut", "exited early", "in time"]
    return _table(title, columns, rows)


def _deadline(c: dict[str, Any]) -> str:
    return "none" if c["deadline_ms"] is None else f"{c['fraction_of_full_p50']}x = {c['deadline_ms']} ms"


def render_exit_default(e: dict[str, Any]) -> list[str]:
    """Each shipped family with default options against itself at full depth, and eval on the same requests."""
    rows, agree = [], []
    for name, f in e["families"].items():
        exit_ = f["policy"]["exit"]
        rule = f"{exit_['rule']} {exit_['threshold']:g}" if exit_ else "none"
        full, default = (
            " / ".join(str(f[k][c]) for c in ("accuracy", "mean_blocks", "latency_mean_ms"))
            for k in ("full", "default")
        )
        cells = [f"{f['blocks_reduction']}x", f["points_lost"], f["latency_mean_ratio"], f["default"]["exited_share"]]
        rows.append(_row(f"{name} ({f['member']})", rule, full, default, *cells))
        ev = f["eval_vs_live"]
        for orders in ("same_orders", "eval_orders"):
            g = ev[orders]
            live = f"{ev['live']['accuracy']} / {ev['live']['mean_blocks']}"
            agree.append(
                _row(
                    name,
                    "the live paths'" if orders == "same_orders" else f"random, mean of {g['draws']} sets",
                    live,
                    f"{g['accuracy']} / {g['mean_blocks']}",
                    g["accuracy_gap_points"],
                    g["same_answer_share"],
                    g["same_blocks_share"],
                )
            )
    title = (
        f"**The shipped families with default options through the swarm** ({e['requests']} held-out requests "
        "each, batch 1, one node per block, the same order for both rows of a request, interleaved)"
    )
    columns = ["family (member)", "default exit", "full: acc / blocks / mean ms", "default: acc / blocks / mean ms"]
    lines = _table(title, [*columns, "blocks reduction", "points lost", "mean latency ratio", "exited"], rows)
    columns = ["family", "eval's orders", "live: acc / blocks", "eval: acc / blocks", "gap (points)"]
    title = "eval's calibration code on the same requests against the live default:"
    return [*lines, "", *_table(title, [*columns, "same answer", "same blocks"], agree)]


def _calibrated(a: dict[str, Any], members: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in members.items():
        c, exit_ = m["calibrated_vs_full"], m["policy"]["exit"]
        rule = f"{exit_['rule']} {exit_['threshold']:g}" if exit_ else "none"
        full, cal = (
            " / ".join(str(c[k][f]) for f in ("accuracy", "mean_blocks", "latency_p50_ms"))
            for k in ("full", "calibrated")
        )
        rows.append(_row(name, rule, full, cal, f"{c['blocks_reduction']}x", c["points_lost"], c["latency_mean_ratio"]))
    title = (
        f"**Adaptive compute through the swarm** (one node per block, batch 1, {a['images']} held-out images, "
        "in-process coordinator, fp16 wire)"
    )
    columns = ["member", "default exit", "full: acc / blocks / p50 ms", "calibrated: acc / blocks / p50 ms"]
    return _table(title, [*columns, "blocks reduction", "points lost", "mean latency ratio"], rows)


def _ensembles(a: dict[str, Any], members: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in members.items():
        e, offline = m["ensemble_noisy"], m["eval_noisy"]
        for over in ("orders", "members"):
            key = f"adaptive_{over}"
            if key not in e:
                continue
            ev = offline[over]
            held = (ev.get("chosen") or {}).get("held_out") or {}
            eval_cell = f"{ev['single_accuracy']['held_out']:.4f} -> {held.get('accuracy', float('nan')):.4f}"
            rows.append(
                _row(
                    name,
                    over if over == "orders" else f"members (+{offline['partner']})",
                    f"{e['single']['accuracy']} / {e['single']['mean_blocks']}",
                    f"{e[key]['accuracy']} / {e[key]['mean_blocks']}",
                    f"{e['threshold']:g}",
                    *_cells(e[key], "second_route_share", "points_gained", "hops_ratio"),
                    eval_cell,
                )
            )
    title = f"Adaptive ensembles (up to 2 routes) on the noisy split (noise std {a['noise']}), no early exit:"
    columns = ["member", "second route over", "single: acc / blocks", "adaptive: acc / blocks", "threshold"]
    return _table(
        title, [*columns, "second route", "points gained", "hops ratio", "eval held out: single -> adaptive"], rows
    )


def _live_vs_eval(members: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in members.items():
        agree = m["live_vs_eval"]
        for rule, by_orders in agree["rules"].items():
            for orders, g in by_orders.items():
                gaps = _cells(g, "max_accuracy_gap", "mean_accuracy_gap", "max_blocks_gap")
                rows.append(_row(name, rule, orders.replace("_", " "), *gaps, agree["accuracy_2se"]))
    title = "Exit curves through the swarm against eval's on the same images (gaps over the threshold sweep):"
    columns = ["member", "rule", "orders", "max accuracy gap", "mean accuracy gap", "max mean-blocks gap", "2 SE"]
    return _table(title, columns, rows)


def _anytime(members: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in members.items():
        t = m["anytime"]
        answered, latency = f"{t['answered']}/{t['requests']}", f"{t['latency_p50_ms']} / {t['latency_max_ms']}"
        rows.append(
            _row(
                name,
                t["deadline_ms"],
                t["min_blocks"],
                answered,
                *_cells(t, "accuracy", "mean_blocks", "blocks_histogram"),
                latency,
            )
        )
    title = "Anytime answers (deadline = half the full path's p50 latency):"
    columns = ["member", "deadline ms", "min blocks", "answered", "accuracy", "mean blocks", "blocks", "p50 / max ms"]
    return _table(title, columns, rows)


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
        rows.append(_row(name, *_cells(m, "start_s", "rss_mib", "rss_anon_mib", "rss_file_mib", "pss_mib")))
    rows += [
        "",
        f"Node RSS x torch-only: {f['node_rss_over_torch_only']}; `layerswarm probe grpc`: {f['probe_s']} s "
        f"({f['probe_over_bare_python']} x a bare `python -c pass`, ok: {f['probe_ok']})"
        + (f"; `layerswarm probe http`: {f['probe_http_s']} s." if "probe_http_s" in f else "."),
    ]
    if "imports" in f:  # where the node's RSS goes, import by import (reports before it lack it)
        steps = ", ".join(f"{s['step']} +{s['adds_mib']}" for s in f["imports"]["steps"])
        rows += ["", f"RSS by import (MiB): interpreter {f['imports']['interpreter_mib']}, {steps}."]
        if "torch" in f["imports"]:
            t = f["imports"]["torch"]
            rows[-1] += f" Of torch's: {t['python_objects_mib']} MiB Python objects of {t['torch_modules']} modules."
    return rows


def _decode_node(d: dict[str, Any]) -> list[str]:
    b = d["block"]
    title = (
        f"**One decoder node, generation** (a block {b['dim']} wide, {b['heads']} heads, streams prefilled with "
        f"{d['prefill_tokens']} tokens, fp16 on the wire, one DecodeStream each; median of {d['steps']} "
        "steps, interleaved)"
    )
    rows = [
        _row(
            "1 stream, a step at a time",
            d["one_stream_step_ms"],
            d["one_stream_compute_ms"],
            d["one_stream_tokens_per_s"],
            "1.00",
            1,
        ),
        _row(
            f"{d['concurrent_streams']} streams stepping at once",
            d["concurrent_round_ms"],
            d["concurrent_round_compute_ms"],
            d["concurrent_tokens_per_s"],
            d["throughput_ratio"],
            d["mean_batched"],
        ),
    ]
    columns = ["streams", "ms per round", "node compute ms", "tokens/s", "x 1 stream", "mean batched"]
    lines = _table(title, columns, rows)
    rule = [_row(c["case"], c["ms"]) for c in d["batching_rule"]]
    last = d["batching_rule"][-1]
    if "max_abs_diff_vs_row_by_row" in last:
        rule.append(
            _row("(padded vs row by row: max abs output difference)", f"{last['max_abs_diff_vs_row_by_row']:.2g}")
        )
    lines += [
        "",
        *_table("Block compute for 8 streams of different lengths (1 thread, this process)", ["calls", "ms"], rule),
    ]
    return lines


def _generation(g: dict[str, Any]) -> list[str]:
    title = (
        f"**Generation through a swarm** ({g['model']}: {g['depth']} node processes, {g['dim']} wide, fp32 on the "
        f"wire; {g['tokens_per_stream']} tokens a stream, {g['rounds']} interleaved rounds)"
    )
    parts = g["floor_parts_ms"]
    rows = [
        _row("batch 1, ms per token", g["batch1_per_token_ms"], "1.00"),
        _row(
            f"floor: {g['depth']} x echo {parts['echo_round_trip']} ms + monolith {parts['monolith_per_token']} ms"
            + (f" (rounds: {g['floor_ms_range'][0]}-{g['floor_ms_range'][1]})" if "floor_ms_range" in g else ""),
            g["floor_ms"],
            f"{g['batch1_over_floor']} (target <= {g['target_batch1_over_floor']})",
        ),
        _row("1 stream, tokens/s", g["tokens_per_s_1_stream"], "1.00"),
        _row(
            "16 streams, tokens/s",
            g["tokens_per_s_16_streams"],
            f"{g['streams_16_over_1']} (target >= {g['target_streams_over_1']})",
        ),
    ]
    if "cpu_ceiling_16_streams" in g:  # reports before 2026-11-28 lack it
        cpu, ceiling = g["swarm_cpu_ms_per_token"], g["cpu_ceiling_16_streams"]
        rows += [
            _row("swarm CPU ms per token, 1 stream", cpu["1_stream"], "-"),
            _row("swarm CPU ms per token, 16 streams", cpu["16_streams"], "-"),
            *(
                [_row("of which the coordinator's", cpu["16_streams_coordinator"], "-")]
                if "16_streams_coordinator" in cpu  # reports before 2026-11-29 lack it
                else []
            ),
            _row(
                f"16 streams' CPU ceiling, tokens/s ({ceiling['cores']} cores always busy)",
                ceiling["tokens_per_s"],
                ceiling["over_1_stream"],
            ),
        ]
        need = ceiling.get("cpu_ms_per_token_for_target")  # reports before 2026-11-29 lack it
        if need:
            rows += [
                _row("CPU ms per token 8x would need, 1 stream as measured", need["one_stream_as_measured"], "-"),
                _row("the same, 1 stream at the batch-1 target", need["one_stream_at_batch1_target"], "-"),
            ]
    lines = _table(title, ["measure", "value", "ratio"], rows)
    for s in [g.get("speculation", {}), g.get("speculation_lan", {}), *g.get("speculation_lan_delay", [])]:
        if "modes" in s:
            lines += ["", *_speculation(s)]
    return lines


def _speculation(s: dict[str, Any]) -> list[str]:
    where = f", each on a host behind a {s['link_mbit']} Mbit/s link" if "link_mbit" in s else " on loopback"
    if "one_way_delay_ms" in s:
        where += f" with {s['one_way_delay_ms']} ms one way from host to host (a user-space switch)"
    title = (
        f"**Self-speculative decoding, batch 1** ({s['model']}: {s['depth']} node processes{where}, drafting with "
        f"{s['draft_depth']} blocks at the coordinator; {s['prompts']} prompts x {s['tokens_per_stream']} tokens, "
        f"{s['rounds']} interleaved rounds; greedy output identical to plain: {s['identical_to_plain']})"
    )
    rows = [
        _row(mode, m["tokens_per_s"], m["over_plain"], m["trips_per_token"], m["acceptance"] or "-")
        for mode, m in s["modes"].items()
    ]
    columns = ["decoding", "tokens/s", f"over plain (target >= {s['target_over_plain']})", "trips/token", "kept"]
    return _table(title, columns, rows)
