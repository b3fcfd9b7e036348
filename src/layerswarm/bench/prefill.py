"""A long prompt's prefill through the swarm against the one-thread monolith (issue 40):

    python -m layerswarm.bench.prefill [--tokens 512] [--reps 7] [--lan] [--chunk 256 128 ...] [--json FILE]

A 12-block, 768-wide decoder with random weights (time, not accuracy) and the shipped language-model
family's tokenizer; a node process per block on loopback (one torch thread each), the coordinator in
this process with its default settings (stem and head on its one compute thread, the default wire). The
swarm's figure is the coordinator's own path to the first token's logits: a stream opened, its prompt
through the stem, every block's node (one hop each, their caches filled) and the head. The monolith's
is the same model's stem, 12 blocks and head over the same prompt on one thread. The swarm prefills two
ways, each through a coordinator of its own over the same nodes: the whole prompt through each node in
turn ("one pass"), and the default, pipelined chunks (coordinator/generation/runner.py: the nodes
compute different chunks at once). All three interleaved, `reps` times, medians compared; the machine is
in the report. `--lan`: every node on a host of its own with a 100 Mbit/s link (harness/netlab.py; tbf
shapes the rate and adds no delay), the coordinator on the bridge.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from layerswarm.coordinator import Coordinator, CoordinatorSettings
from layerswarm.coordinator.generation.options import GenerationOptions
from layerswarm.harness.netlab import NetLab
from layerswarm.harness.netns import bench_in_private_netns, in_private_netns
from layerswarm.harness.procs import Proc, node_address, node_cmd, spawn_many, stop_all
from layerswarm.harness.shaping import shaped_hosts
from layerswarm.models.checkpoint import Lineage, save_model
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.model import DecoderLM
from layerswarm.models.lm.tokenizer import TOKENIZER_FILE
from layerswarm.models.zoo import family_root
from layerswarm.wire.auth import ensure_token_file
from layerswarm.wire.security import SecuritySettings

from . import emit_report
from .machine import environment

log = logging.getLogger(__name__)
LINK_MBIT = 100
# The ways a coordinator prefills, compared in one run: the whole prompt through each node in turn ("one
# pass", chunk 0), and pipelined chunks (runner.py; the coordinator's default chunk unless told).
DEFAULT_CHUNK: int = CoordinatorSettings.model_fields["prefill_chunk_tokens"].default
SHAPE: dict[str, Any] = {"vocab_size": 512, "dim": 768, "depth": 12, "heads": 12, "kv_heads": 12, "max_seq_len": 1024}


def model_dir(root: Path, shape: dict[str, Any]) -> tuple[Path, DecoderLM]:
    """A decoder of `shape`, random weights, with the shipped family's tokenizer (vocabulary 512)."""
    torch.manual_seed(0)
    out = root / f"decoder-{shape['depth']}x{shape['dim']}-random"
    out.mkdir(parents=True)
    shutil.copy(family_root("lm") / "layershuffle-0" / TOKENIZER_FILE, out / TOKENIZER_FILE)
    model = DecoderLM(LMConfig(**shape)).eval()
    save_model(model, out, Lineage(source="scratch"))
    return out, model


def monolith(model: DecoderLM, prompt: list[int]) -> tuple[float, torch.Tensor]:
    """Stem, every block and the head over the prompt, one thread: seconds, and the first token's logits."""
    started = time.perf_counter()
    with torch.inference_mode():
        x = model.stem(torch.tensor([prompt]))
        for block in model.route():
            x = block(x)
        logits = model.head(x[:, -1])
    return time.perf_counter() - started, logits


async def swarm(coord: Coordinator, prompt: list[int]) -> tuple[float, torch.Tensor]:
    generator = coord.generator
    started = time.perf_counter()
    stream = await generator.open(prompt, GenerationOptions(max_tokens=1))
    try:
        logits = await generator.prefill(stream)
        return time.perf_counter() - started, logits
    finally:
        generator.close(stream)
        await generator.releases_done()


def start_nodes(path: Path, depth: int, lab: NetLab | None, secured: tuple[str, ...]) -> list[Proc]:
    """A node process per block: on loopback, or each on a LAN host of its own with a shaped link."""
    if lab is None:
        return spawn_many([(f"node-{b}", node_cmd(path, b, "--no-advertise")) for b in range(depth)])
    hosts = shaped_hosts(lab, depth, "p", LINK_MBIT)
    flags = ("--no-advertise", "--grace", "0.2", *secured)
    specs = [(f"lan-node-{b}", h.command(node_cmd(path, b, *flags, host=h.address))) for b, h in enumerate(hosts)]
    return spawn_many(specs, timeout=300)


async def measure(
    path: Path, model: DecoderLM, tokens: int, reps: int, lab: NetLab | None, chunks: tuple[int, ...]
) -> dict[str, Any]:
    cfg = model.cfg
    draws = torch.randint(3, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    prompt = [1, *(int(t) for t in draws[1:])]  # <s> first, as the coordinator's own prompts
    token = path.parent / "swarm.token"
    ensure_token_file(token)  # nodes on LAN addresses need the swarm's token (secure by default)
    nodes = start_nodes(path, cfg.depth, lab, ("--token-file", str(token)))
    peers = tuple(node_address(n) for n in nodes)
    security = SecuritySettings.from_files(token_file=token) if lab is not None else SecuritySettings()
    # One coordinator per way of prefilling, over the same nodes, measured interleaved in one run.
    coords = {
        way: Coordinator(
            CoordinatorSettings(model_dir=path, peers=peers, mdns=False, prefill_chunk_tokens=size, security=security)
        )
        for way, size in {"one pass": 0, **{f"chunk {c}": c for c in chunks}}.items()
    }
    times: dict[str, list[float]] = {"monolith": [], **{way: [] for way in coords}}
    diff = 0.0
    try:
        for coord in coords.values():
            await coord.start()
            await swarm(coord, prompt[:8])  # connections and the nodes' first call
        _, reference = monolith(model, prompt)
        for _ in range(reps):
            times["monolith"].append(monolith(model, prompt)[0])
            for way, coord in coords.items():
                seconds, logits = await swarm(coord, prompt)
                times[way].append(seconds)
                diff = max(diff, float((logits.float() - reference.float()).abs().max()))
    finally:
        for coord in coords.values():
            await coord.stop()
        stop_all(nodes)
    ms = {way: statistics.median(t) * 1e3 for way, t in times.items()}
    m, first = ms["monolith"], f"chunk {chunks[0]}"
    return {
        "logits_max_abs_diff": diff,  # the same work: the swarm's first-token logits against the monolith's
        "prompt_tokens": tokens,
        "reps": reps,
        "network": "loopback" if lab is None else f"a host per node, {LINK_MBIT} Mbit/s links (tc tbf, no delay)",
        "prefill_chunk": chunks[0],
        "monolith_ms": round(m, 1),
        "swarm_ms": round(ms[first], 1),  # pipelined in chunks of the first size (the default unless told)
        "swarm_over_monolith": round(ms[first] / m, 3),
        "one_pass_ms": round(ms["one pass"], 1),
        "one_pass_over_monolith": round(ms["one pass"] / m, 3),
        "by_chunk": {
            c: {"ms": round(ms[f"chunk {c}"], 1), "over_monolith": round(ms[f"chunk {c}"] / m, 3)} for c in chunks
        },
        "target": "<= 1.3",
        **{f"{way.replace(' ', '_')}_ms_all": [round(v * 1e3, 1) for v in t] for way, t in times.items()},
    }


def run(
    tokens: int, reps: int, shape: dict[str, Any] = SHAPE, lan: bool = False, chunks: tuple[int, ...] = (DEFAULT_CHUNK,)
) -> dict[str, Any]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path, model = model_dir(Path(tmp), shape)
        if not lan:
            figures = asyncio.run(measure(path, model, tokens, reps, None, chunks))
        else:
            with NetLab() as lab:
                figures = asyncio.run(measure(path, model, tokens, reps, lab, chunks))
    return {"environment": environment(), "model": shape, **figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerswarm.bench.prefill", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="prompt length")
    p.add_argument("--reps", type=int, default=7, help="interleaved measurements of each")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument(
        "--lan",
        action="store_true",
        help=f"every node on a host of its own, links shaped to {LINK_MBIT} Mbit/s (needs root; runs in a "
        "private network namespace)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        nargs="+",
        default=[DEFAULT_CHUNK],
        metavar="TOKENS",
        help=f"pipelined chunk sizes to compare in the same run, beside one pass (default: the coordinator's "
        f"{DEFAULT_CHUNK}); the first is the headline",
    )
    args = p.parse_args(argv)
    if any(c < 1 for c in args.chunk):
        p.error(f"--chunk: sizes of 1 token or more, not {args.chunk}")
    if not 2 <= args.tokens <= SHAPE["max_seq_len"]:
        p.error(f"--tokens: 2 to the model's context of {SHAPE['max_seq_len']}, not {args.tokens}")
    if args.reps < 1:
        p.error(f"--reps: at least 1, not {args.reps}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.lan and not in_private_netns():
        flags = ["--tokens", str(args.tokens), "--reps", str(args.reps), "--lan", "--chunk", *map(str, args.chunk)]
        report = bench_in_private_netns("layerswarm.bench.prefill", False, flags)
        return emit_report(report, args.json)
    return emit_report(run(args.tokens, args.reps, lan=args.lan, chunks=tuple(args.chunk)), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
