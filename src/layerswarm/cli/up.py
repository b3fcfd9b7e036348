"""`layerswarm up`: a whole swarm on this machine, from the shipped weights, end to end.

Starts nodes from several models of one family (so substitution really happens), a coordinator with
its HTTP server, classifies sample images over HTTP, kills some nodes, and shows that requests still
succeed, with the traces. A language-model family (`--family lm`) streams completions instead and kills
the nodes mid-stream (up_lm.py).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import up_lm
from .base import Subparsers, UsageError, add_command, non_negative_int, positive_int
from .swarm_demo import VICTIMS, UpOptions, choose_victims, family_members, is_decoder_family, progress, start_swarm


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "up",
        run,
        help="run a local swarm end to end (the demo)",
        description="Start nodes from the shipped family, a coordinator, classify images over HTTP, kill "
        "nodes, and show requests still succeed. With a language-model family (--family lm): stream "
        "completions over the OpenAI-compatible API, SIGKILL nodes mid-stream, and show every stream "
        "finishing ([DONE]) with its rebuilt and skipped hops. Progress goes to stderr.",
    )
    p.add_argument("--nodes", type=positive_int, help="how many nodes (none: two models per block)")
    p.add_argument("--kill", type=non_negative_int, help="how many nodes to SIGKILL mid-run (none: a third)")
    p.add_argument(
        "--victims",
        choices=sorted(VICTIMS),
        default=UpOptions.victims,
        help="which nodes die: " + "; ".join(f"{name}: {what}" for name, what in VICTIMS.items()),
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=UpOptions.requests_per_phase,
        help="requests before and after the kills (each)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.add_argument(
        "--network",
        choices=["auto", "netns", "loopback"],
        default="auto",
        help="netns: mDNS inside a private network namespace; loopback: static peers on 127.0.0.1, "
        "no multicast; auto: netns when possible",
    )
    p.add_argument(
        "--family",
        help="the family to run: a shipped one by name (shapes, text, lm) or zoo:NAME, or a folder of its "
        "model directories (none: shapes)",
    )
    p.add_argument(
        "--streams",
        type=positive_int,
        default=up_lm.STREAMS,
        help="language models: concurrent streams before and during the kills (each)",
    )
    p.add_argument(
        "--speculation",
        default="off",
        help="language models: every stream's self-speculative decoding: off, auto, or K drafts a trip (1 to 16)",
    )
    # Until 2026-11-27 `up` took a family folder as --family-dir, which names one more member's model
    # directory in `coordinator`: kept, hidden, with a warning, so that old command lines still run.
    p.add_argument("--family-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=UpOptions.seed, help="seed of samples, paths and victims")


def run(args: argparse.Namespace) -> int:
    if not (args.speculation in ("off", "auto") or (args.speculation.isdigit() and int(args.speculation) <= 16)):
        raise UsageError(f"--speculation {args.speculation}: off, auto, or a number of drafts 0 to 16")
    if args.kill is not None and args.nodes is not None and args.kill >= args.nodes:
        raise UsageError(f"--kill {args.kill} must leave a node alive (--nodes {args.nodes})")
    family_dir, flag = chosen_family(args)
    check_node_count(args.nodes, family_dir, flag)
    mdns = network_with_mdns(args.network, args.argv)
    if not isinstance(mdns, bool):
        return mdns  # the exit status: re-executed in a private namespace, or refused
    from layerswarm.harness.procs import ProcessError

    opts = UpOptions(args.nodes, args.requests, args.kill, mdns, family_dir, args.seed, victims=args.victims)
    decoder = is_decoder_family(family_dir)
    try:
        summary = up_lm.run_up_lm(opts, args.streams, args.speculation) if decoder else run_up(opts)
    except (ProcessError, TimeoutError) as exc:  # a swarm that did not come up: say which part, not where
        print(f"layerswarm up: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(to_json(summary))
    else:
        print(up_lm.render(summary) if decoder else render(summary))
    if decoder:
        return 0 if summary["done"] == summary["streams"] else 1
    return 0 if summary["succeeded"] == summary["requests"] else 1


def chosen_family(args: argparse.Namespace) -> tuple[Path, str]:
    """The family folder to run and the flag that named it: --family (a shipped name, zoo:NAME or a
    folder), else the deprecated --family-dir, else the shipped shapes family."""
    from layerswarm.models.zoo import family_root, resolve_family

    if args.family_dir is not None:
        progress(
            "--family-dir is deprecated in up: use --family DIR (in coordinator, --family-dir names another "
            "member's model directory)"
        )
        if args.family is None:
            return existing_folder(Path(args.family_dir), f"--family-dir {args.family_dir}"), "--family-dir"
    if args.family is None:
        return family_root(), "--family"
    try:
        family_dir = resolve_family(args.family)
    except ValueError as exc:  # a zoo: name that is not shipped; it lists the shipped ones
        raise UsageError(f"--family {exc}") from None
    return existing_folder(family_dir, f"--family {args.family}", "a shipped family's name, or a folder"), "--family"


def existing_folder(path: Path, given: str, hint: str = "a folder of model directories") -> Path:
    if not path.is_dir():
        raise UsageError(f"{given}: no such folder ({hint})")
    return path


def check_node_count(nodes: int | None, family_dir: Path, flag: str) -> None:
    """Before anything starts: the family is usable and --nodes covers every block index (node k serves
    block k % depth, so fewer nodes than blocks leave indices nobody serves and the swarm never comes up)."""
    try:
        _, depth = family_members(family_dir)
    except (OSError, ValueError) as exc:  # no model directories; a broken manifest (ModelDirError)
        raise UsageError(f"{flag} {family_dir}: {exc}") from None
    if nodes is not None and nodes < depth:
        raise UsageError(
            f"--nodes {nodes}: at least {depth} needed, one per block index (the family's models have {depth} blocks)"
        )


def network_with_mdns(network: str, argv: list[str]) -> bool | int:
    """Whether this run discovers over mDNS; or the exit status once `up` re-ran itself in a private
    network namespace (so that no multicast leaves this machine) or could not."""
    from layerswarm.harness import netns

    mdns = network != "loopback"
    if mdns and not netns.in_private_netns():
        if netns.can_unshare():
            progress("running in a private network namespace (unshare): no multicast reaches your LAN")
            return netns.reexec_in_private_netns(argv)
        if network == "netns":
            print("layerswarm up: error: --network netns needs `unshare` (root or user namespaces)", file=sys.stderr)
            return 2
        progress("no private network namespace available: static peers on 127.0.0.1 (no multicast leaves)")
        mdns = False
    if mdns and not netns.loopback_multicast_ready():
        print("layerswarm up: error: loopback has no multicast; run: " + netns.LOOPBACK_MULTICAST, file=sys.stderr)
        return 2
    return mdns


@dataclass
class Phase:
    name: str
    results: list[dict[str, Any]] = field(default_factory=list)

    def tally(self) -> dict[str, Any]:
        ok = [r for r in self.results if r["status"] == 200]
        blocks = [r["blocks"] for r in ok]
        return {
            "requests": len(self.results),
            "succeeded": len(ok),
            "failed": len(self.results) - len(ok),
            "accuracy": round(sum(r["correct"] for r in ok) / len(ok), 4) if ok else 0.0,
            "substituted_hops": sum(r.get("substituted", 0) for r in ok),
            "skipped_hops": sum(r.get("skipped", 0) for r in ok),
            # blocks each answered request ran, in order; the exit rule stops a sure one early
            "mean_blocks": round(sum(blocks) / len(blocks), 3) if blocks else None,
            "exited_early": sum(r["exited_early"] for r in ok),
            "blocks_per_request": blocks,
        }


def classify_many(client: Any, phase: Phase, samples: list[Any], rng: random.Random) -> None:
    progress(f"{phase.name}: classifying {len(samples)} samples over HTTP...")
    for sample in samples:
        label = sample.label
        seed = rng.randrange(2**31)
        if isinstance(sample.png, str):  # a text family's sample: the text itself
            reply = client.post("/v1/classify/text", json={"text": sample.png, "seed": seed})
        else:
            reply = client.post(
                "/v1/classify", files={"file": ("x.png", sample.png, "image/png")}, data={"seed": str(seed)}
            )
        body = reply.json()
        row: dict[str, Any] = {"status": reply.status_code, "label": label}
        if reply.status_code == 200:
            row.update(
                correct=body["prediction"] == label,
                prediction=body["prediction"],
                depth=body["depth"],
                blocks=body["blocks"],
                exited_early=body["exited_early"],
                substituted=body["trace"]["substituted"],
                skipped=body["trace"]["skipped"],
                trace=body["trace"],
            )
        else:
            row.update(correct=False, error=body)
        phase.results.append(row)


TEXT_DATA = ("words", "csv", "jsonl")


def text_samples(model_dir: Path, indices: list[int]) -> list[Any]:
    """A text family's test sentences with their class names (sent as {"text": ...})."""
    from layerswarm.harness.samples import Sample
    from layerswarm.models.checkpoint import read_manifest
    from layerswarm.training.text.data import load_corpus

    manifest = read_manifest(model_dir)
    corpus = load_corpus(str(manifest.dataset["spec"]), seed=int(manifest.dataset.get("data_seed", 0)))
    return [Sample(corpus.test_texts[i], corpus.class_names[int(corpus.test_y[i])]) for i in indices]  # type: ignore[arg-type]


def run_up(opts: UpOptions) -> dict[str, Any]:
    import httpx

    from layerswarm.harness.procs import stop_all
    from layerswarm.harness.samples import labelled_samples, task_data
    from layerswarm.harness.swarm import wait_for_swarm

    rng = random.Random(opts.seed)
    nodes, coordinator, members = start_swarm(opts)
    try:
        data = task_data(members[0])
        picked = rng.sample(range(len(data.test_y)), 2 * opts.requests_per_phase)
        samples = text_samples(members[0], picked) if data.name in TEXT_DATA else labelled_samples(data, picked)
        base = f"http://127.0.0.1:{coordinator.ready['port']}"
        with httpx.Client(base_url=base, timeout=30.0) as client:
            progress(f"coordinator on {base}; waiting until all {len(nodes)} nodes are healthy...")
            wait_for_swarm(client, len(nodes), opts.timeout_s)
            before = Phase("all nodes up")
            classify_many(client, before, samples[: opts.requests_per_phase], rng)
            asked = opts.kill if opts.kill is not None else len(nodes) // 3
            killed = choose_victims(nodes, asked, rng, opts.victims)
            if len(killed) < asked:
                progress(f"--kill {asked}: only {len(killed)} can go (every block index but one keeps a node)")
            victims = f"{len(killed)} node{'s' if len(killed) != 1 else ''}"
            progress(f"killing {victims} (SIGKILL)...")
            for proc in killed:
                proc.signal(signal.SIGKILL)
            after = Phase(f"{victims} killed")
            classify_many(client, after, samples[opts.requests_per_phase :], rng)
            view = client.get("/v1/nodes").json()
        summary = summarise([before, after], nodes, killed, view)
        return {**summary, "depth": view.get("depth"), "block_rule": coordinator.ready.get("readiness")}
    finally:
        progress("stopping the swarm...")
        stop_all([coordinator, *nodes])


def summarise(phases: list[Phase], nodes: list[Any], killed: list[Any], view: dict[str, Any]) -> dict[str, Any]:
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
    lines.append(
        f"{'phase':<22}{'requests':>9}{'ok':>6}{'failed':>8}{'accuracy':>10}{'substituted':>13}{'skipped':>9}"
        f"{'blocks/req':>12}{'exited':>8}"
    )
    for name, t in [*summary["phases"].items(), ("total", summary)]:
        lines.append(
            f"{name:<22}{t['requests']:>9}{t['succeeded']:>6}{t['failed']:>8}{t['accuracy']:>10.3f}"
            f"{t['substituted_hops']:>13}{t['skipped_hops']:>9}{_mean(t['mean_blocks']):>12}{t['exited_early']:>8}"
        )
    lines += ["", f"blocks per request (of {summary['depth']}; the exit rule stops sure answers early):"]
    lines += [f"  {name}: {_histogram(t['blocks_per_request'])}" for name, t in summary["phases"].items()]
    trace = summary.get("example_trace")
    if trace:
        lines += ["", "one request after the kills (position: block @ node [model] outcome):"]
        lines += [_render_hop(hop) for hop in trace["hops"]]
    lines.append("")
    lines.append(f"swarm after: {summary['swarm_after']}")
    return "\n".join(lines)


def _mean(blocks: float | None) -> str:
    return "-" if blocks is None else f"{blocks:.2f}"


def _histogram(blocks: list[int]) -> str:
    """`8 blocks x 30, 5 x 6, ...`: how many requests ran each number of blocks, deepest first."""
    counts = sorted(Counter(blocks).items(), reverse=True)
    return (
        ", ".join(
            f"{d} block{'s' if d != 1 else ''} x {n}" if i == 0 else f"{d} x {n}" for i, (d, n) in enumerate(counts)
        )
        or "-"
    )


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
