"""A long prompt's prefill through the swarm against the one-thread monolith (issue 40):

    python -m layerswarm.bench.prefill [--tokens 512] [--reps 7] [--json FILE]

A 12-block, 768-wide decoder with random weights (time, not accuracy) and the shipped language-model
family's tokenizer; a node process per block on loopback (one torch thread each), the coordinator in
this process with its default settings (stem and head on its one compute thread, the default wire). The
swarm's figure is the coordinator's own path to the first token's logits: a stream opened, its prompt
through the stem, every block's node (one hop each, their caches filled) and the head. The monolith's
is the same model's stem, 12 blocks and head over the same prompt on one thread. Both interleaved,
`reps` times, medians compared; the machine is in the report.
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
from layerswarm.harness.procs import node_address, node_cmd, spawn_many, stop_all
from layerswarm.models.checkpoint import Lineage, save_model
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.model import DecoderLM
from layerswarm.models.lm.tokenizer import TOKENIZER_FILE
from layerswarm.models.zoo import family_root

from . import emit_report
from .machine import environment

log = logging.getLogger(__name__)
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


async def measure(path: Path, model: DecoderLM, tokens: int, reps: int) -> dict[str, Any]:
    cfg = model.cfg
    draws = torch.randint(3, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    prompt = [1, *(int(t) for t in draws[1:])]  # <s> first, as the coordinator's own prompts
    nodes = spawn_many([(f"node-{b}", node_cmd(path, b, "--no-advertise")) for b in range(cfg.depth)])
    coord = Coordinator(CoordinatorSettings(model_dir=path, peers=tuple(node_address(n) for n in nodes), mdns=False))
    await coord.start()
    try:
        await swarm(coord, prompt[:8])  # connections and the nodes' first call
        _, reference = monolith(model, prompt)
        mono: list[float] = []
        through: list[float] = []
        diff = 0.0
        for _ in range(reps):
            mono.append(monolith(model, prompt)[0])
            seconds, logits = await swarm(coord, prompt)
            through.append(seconds)
            diff = max(diff, float((logits.float() - reference.float()).abs().max()))
    finally:
        await coord.stop()
        stop_all(nodes)
    m, s = statistics.median(mono), statistics.median(through)
    return {
        "logits_max_abs_diff": diff,  # the same work: the swarm's first-token logits against the monolith's
        "prompt_tokens": tokens,
        "reps": reps,
        "monolith_ms": round(m * 1e3, 1),
        "swarm_ms": round(s * 1e3, 1),
        "swarm_over_monolith": round(s / m, 3),
        "target": "<= 1.3",
        "monolith_ms_all": [round(v * 1e3, 1) for v in mono],
        "swarm_ms_all": [round(v * 1e3, 1) for v in through],
    }


def run(tokens: int, reps: int, shape: dict[str, Any] = SHAPE) -> dict[str, Any]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path, model = model_dir(Path(tmp), shape)
        figures = asyncio.run(measure(path, model, tokens, reps))
    return {"environment": environment(), "model": shape, **figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerswarm.bench.prefill", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="prompt length")
    p.add_argument("--reps", type=int, default=7, help="interleaved measurements of each")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return emit_report(run(args.tokens, args.reps), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
