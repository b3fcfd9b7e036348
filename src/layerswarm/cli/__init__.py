"""The `layerswarm` command line: train, family, eval, node, coordinator, up."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from layerswarm import __version__

from .args import (
    add_coordinator_args,
    add_node_args,
    add_security_args,
    add_up_args,
    security_from_args,
)

if TYPE_CHECKING:
    from layerswarm.node.settings import NodeSettings

EXAMPLES = """\
examples:
  layerswarm up                                   # a local swarm from the shipped weights, end to end
  layerswarm train --data shapes --variant layershuffle --out runs/ls
  layerswarm family --base runs/base --members 4 --out runs/family
  layerswarm eval runs/family/member-* --json report.json --plots figures/
  layerswarm node --model-dir runs/family/member-0 --block 3 --host 0.0.0.0 --port 50051
  layerswarm coordinator --model-dir runs/family/member-0 --http-port 8080
"""


class Parser(argparse.ArgumentParser):
    """argparse, but errors name the command and exit 2 without a traceback."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from layerswarm.models.commands import add_eval_args, add_family_args, add_train_args

    parser = Parser(
        prog="layerswarm",
        description="Distributed edge inference: every transformer block is its "
        "own network node, and a coordinator routes through them in any order.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"layerswarm {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("LAYERSWARM_LOG", "WARNING"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    add_train_args(
        sub.add_parser(
            "train",
            help="train one model (LayerShuffle and its variants, baselines)",
            description="Train one model and write a model directory (manifest + "
            "safetensors per stem, block and head).",
        )
    )
    add_family_args(
        sub.add_parser(
            "family",
            help="fine-tune K members from one base: a mergeable family",
            description="Fine-tune K models from one base model with different seeds. "
            "Members share the base's family id, so their blocks can be mixed.",
        )
    )
    add_eval_args(
        sub.add_parser(
            "eval",
            help="the paper's experiments: orders, pruning, merging, ensembles",
            description="Sequential and arbitrary-order accuracy, pruning, merged models "
            "and ensembles, as JSON (and plots).",
        )
    )
    add_node_args(
        sub.add_parser(
            "node",
            help="serve one block over gRPC, advertised over mDNS",
            description="Load one block (sha256-verified), serve it over gRPC with health "
            "checks and metrics, and advertise it as _layerswarm._tcp.local.",
        )
    )
    add_coordinator_args(
        sub.add_parser(
            "coordinator",
            help="discover nodes, route requests, serve HTTP",
            description="Own stem and head, discover the family's nodes (mDNS and "
            "static peers), and serve POST /v1/classify.",
        )
    )
    add_up_args(
        sub.add_parser(
            "up",
            help="run a local swarm end to end (the demo)",
            description="Start nodes from the shipped family, a coordinator, classify "
            "images over HTTP, kill nodes, and show requests still succeed.",
        )
    )
    bench = sub.add_parser(
        "bench",
        help="the benchmark suite: swarm vs monolith, hop vs TCP, wire, concurrency",
        description="Measure the swarm against a monolith and raw TCP in one run; JSON and "
        "markdown out. --quick finishes in a few minutes.",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (CI runs this)")
    bench.add_argument("--json", type=Path, help="write the report as JSON here")
    bench.add_argument("--markdown", type=Path, help="write the tables as markdown here")
    chaos = sub.add_parser(
        "chaos",
        help="failure injection: load plus faults on a one-host-per-node swarm, a report",
        description="Every node its own host (network namespace on a bridge), discovering over "
        "mDNS; a bounded load generator; faults on a seeded schedule (kill, freeze, pulled "
        "cable, dropped packets, netem delay where the kernel has it, slow and malformed nodes, "
        "restarts, joins, coordinator restart), with rogue nodes and a forging device (forged mDNS "
        "goodbyes and adverts, token theft) on a token-protected swarm; a report with pass/fail per "
        "target. --soak: continuous churn for --duration. Needs root; runs in a private namespace.",
    )
    chaos.add_argument(
        "--requests", type=int, help="requests to send (default: 5000 for the attack run, 1000 with --basic)"
    )
    chaos.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default: %(default)s)")
    chaos.add_argument("--hold", type=float, default=2.0, help="seconds each fault lasts (default: %(default)s)")
    chaos.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    chaos.add_argument("--quick", action="store_true", help="a short variant: fewer requests, shorter faults (CI)")
    chaos.add_argument(
        "--basic",
        action="store_true",
        help="the failure schedule alone (no rogue nodes, no forging device, no token)",
    )
    chaos.add_argument("--json", type=Path, help="write the report as JSON here")
    chaos.add_argument(
        "--soak",
        action="store_true",
        help="continuous churn (faults, rogues, joins, forged adverts) for --duration seconds; reports "
        "coordinator and node memory and open files at start and end",
    )
    chaos.add_argument("--duration", type=float, default=1800.0, help="soak length in seconds (default: %(default)s)")
    probe = sub.add_parser(
        "probe",
        help="health check a node (gRPC) or coordinator (HTTP); exit 0 if healthy",
        description="For container HEALTHCHECKs and systemd: grpc HOST:PORT asks the standard "
        "grpc.health.v1 service; http URL expects a 2xx.",
    )
    probe.add_argument("kind", choices=["grpc", "http"])
    probe.add_argument("target", help="HOST:PORT (grpc) or URL (http)")
    probe.add_argument("--timeout", type=float, default=2.0)
    add_security_args(probe, token=False)  # the health service needs no token, but TLS is the whole port
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = "layerswarm " + " ".join(argv)  # recorded in manifests: how a model was made
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _dispatch(args, argv)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as exc:  # ModelDirError is a ValueError
        print(f"layerswarm {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "train":
        from layerswarm.models.commands import train_main

        return train_main(args)
    if args.command == "family":
        from layerswarm.models.commands import family_main

        return family_main(args)
    if args.command == "eval":
        from layerswarm.models.commands import eval_main

        return eval_main(args)
    if args.command == "node":
        return _node(args)
    if args.command == "coordinator":
        return _coordinator(args)
    if args.command == "chaos":
        return _chaos(args, argv)
    if args.command == "bench":
        from layerswarm.bench.runner import main as bench_main

        return bench_main(args.quick, args.json, args.markdown)
    if args.command == "probe":
        from .probe import probe_grpc, probe_http

        if args.kind == "grpc":
            healthy, message = probe_grpc(args.target, args.timeout, security_from_args(args))
        else:
            healthy, message = probe_http(args.target, args.timeout)
        print(message)
        return 0 if healthy else 1
    return _up(args, argv)


def _node_settings(args: argparse.Namespace) -> NodeSettings:
    from layerswarm.node.settings import NodeSettings

    return NodeSettings(
        model_dir=args.model_dir,
        block=args.block,
        host=args.host,
        port=args.port,
        device=args.device,
        threads=args.threads,
        max_in_flight=args.max_in_flight,
        max_batch=args.max_batch,
        micro_batch=not args.no_micro_batch,
        metrics_port=args.metrics_port,
        advertise=not args.no_advertise,
        advertise_address=args.advertise_address,
        mdns_interfaces=tuple(args.mdns_interface),
        grace_s=args.grace,
        security=security_from_args(args),
    )


def node_settings_from_argv(argv: list[str]) -> NodeSettings:
    """`layerswarm node` arguments to settings, with the CLI's logging (for harness/faults.py)."""
    args = build_parser().parse_args(["node", *argv])
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _node_settings(args)


def _node(args: argparse.Namespace) -> int:
    from layerswarm.node.server import run

    return run(_node_settings(args))


def _coordinator(args: argparse.Namespace) -> int:
    from layerswarm.coordinator.peer_memory import default_state_file
    from layerswarm.coordinator.server import run
    from layerswarm.coordinator.settings import CoordinatorSettings

    state_file = None if args.no_state_file else (args.state_file or default_state_file(args.http_port))

    return run(
        CoordinatorSettings(
            model_dir=args.model_dir,
            family_dirs=tuple(args.family_dir),
            peers=tuple(args.peer),
            peer_dns=tuple(args.peer_dns),
            mdns=not args.no_mdns,
            mdns_interfaces=tuple(args.mdns_interface),
            http_host=args.http_host,
            http_port=args.http_port,
            default_policy=args.policy,
            min_blocks=args.min_blocks,
            strict=False if args.no_strict else None,
            verify_rate=None if args.no_verify else args.verify_rate,
            verify_probation=args.verify_probation,
            hop_timeout_s=args.hop_timeout,
            request_timeout_s=args.request_timeout,
            health_interval_s=args.health_interval,
            hedge_quantile=args.hedge_quantile or None,
            hedge_min_ms=args.hedge_min_ms,
            wire_dtype=args.wire_dtype,
            transport=args.transport,
            max_upload_bytes=args.max_upload_bytes,
            security=security_from_args(args),
            state_file=state_file,
        )
    )


def _chaos(args: argparse.Namespace, argv: list[str]) -> int:
    from layerswarm.harness import netns

    if not netns.in_private_netns():
        if os.geteuid() != 0 or not netns.can_unshare():
            print("layerswarm chaos: error: needs root and `unshare` (it builds network namespaces)", file=sys.stderr)
            return 2
        return netns.reexec_in_private_netns(argv)
    from layerswarm.chaos.main import run_from_args

    return run_from_args(args)


def _up(args: argparse.Namespace, argv: list[str]) -> int:
    from layerswarm.harness import netns

    from .up import UpOptions, render, run_up, to_json

    mdns = args.network != "loopback"
    if mdns and not netns.in_private_netns():
        if netns.can_unshare():
            return netns.reexec_in_private_netns(argv)
        if args.network == "netns":
            print("layerswarm up: error: --network netns needs `unshare` (root or user namespaces)", file=sys.stderr)
            return 2
        print(
            "layerswarm up: no private network namespace available: using static peers on 127.0.0.1 "
            "(no multicast leaves this machine)",
            file=sys.stderr,
        )
        mdns = False
    if mdns and not netns.loopback_multicast_ready():
        print("layerswarm up: error: loopback has no multicast; run: " + netns.LOOPBACK_MULTICAST, file=sys.stderr)
        return 2
    summary = run_up(
        UpOptions(
            nodes=args.nodes,
            requests_per_phase=args.requests,
            kill=args.kill,
            mdns=mdns,
            family_dir=args.family_dir,
            seed=args.seed,
        )
    )
    print(to_json(summary) if args.json else render(summary))
    return 0 if summary["succeeded"] == summary["requests"] else 1
