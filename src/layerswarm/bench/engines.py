"""Block engines compared: the numpy engine, the torch engine and ONNX Runtime, on the same block.

Per engine: what importing its runtime costs a fresh interpreter (RSS, seconds), and the median time of
one block call, interleaved round by round: a forward of the shipped family's block 0 (batch 1 and 16),
and for a decoder block 768 wide (random weights) a prefill of 32 tokens and one decode step, and at each
of DECODER_WIDTHS a 100-token prefill and a step after it (what `--engine auto` decides on). ONNX Runtime
runs the torch block exported to ONNX (torch.onnx, opset 17) where `onnxruntime` and `onnx` are
importable; it has no KV-cache step here (a cache is state that ONNX graphs take as inputs and return,
copied every call), so its decode figures are absent. Why numpy was chosen: docs/deploy.md.

    python -m layerswarm.bench.engines --json docs/results/engines.json
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from layerswarm.bench import emit_report
from layerswarm.bench.machine import environment
from layerswarm.models.checkpoint import Lineage, read_any_manifest, read_manifest, save_model
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.model import DecoderLM
from layerswarm.models.zoo import family_root, robust_members
from layerswarm.node.engines import BlockEngine, load_engine
from layerswarm.node.settings import BLAS_THREADS

IMPORT_COST = """
import json, sys, time
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
before, started = rss(), time.perf_counter()
__import__(sys.argv[1])
print(json.dumps({"adds_mib": round(rss() - before, 1), "seconds": round(time.perf_counter() - started, 3)}))
"""
RUNTIMES = {"numpy": "numpy", "torch": "torch", "onnxruntime": "onnxruntime"}
DECODER = {"vocab_size": 512, "dim": 768, "depth": 1, "heads": 12, "kv_heads": 4, "max_seq_len": 128}


def import_cost(module: str) -> dict[str, Any] | None:
    if importlib.util.find_spec(module) is None:
        return None
    cmd = [sys.executable, "-c", IMPORT_COST, module]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 3)


def onnx_session(engine: BlockEngine, x: np.ndarray) -> Callable[[np.ndarray], np.ndarray] | None:
    """The torch engine's block exported to ONNX and loaded by ONNX Runtime (one thread), or None when
    onnxruntime or onnx is not installed."""
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        return None
    import onnxruntime as ort  # noqa: PLC0415 - optional: only where installed for this comparison

    block = getattr(engine, "block")  # noqa: B009 - the torch engine's module

    class AtZero(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.block(t, 0)  # type: ignore[no-any-return]

    buffer = io.BytesIO()
    torch.onnx.export(
        AtZero().eval(),
        (torch.from_numpy(x),),
        buffer,  # type: ignore[arg-type]  # a file object works (torch's own examples use BytesIO)
        dynamo=False,
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
        opset_version=17,
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])

    def run(a: np.ndarray) -> np.ndarray:
        out: np.ndarray = session.run(None, {"x": a})[0]
        return out

    return run


def forward_figures(reps: int) -> dict[str, Any]:
    member = robust_members(family_root())[0]
    manifest = read_manifest(member)
    engines = {name: load_engine(member, 0, manifest, name, "cpu") for name in ("torch", "numpy")}
    cfg = manifest.config
    rows: dict[str, dict[str, float]] = {}
    for batch in (1, 16):
        x = np.random.default_rng(0).standard_normal((batch, cfg.num_tokens, cfg.dim), dtype=np.float32)
        calls: dict[str, Callable[[], object]] = {n: partial(e.forward, x, 0) for n, e in engines.items()}
        run = onnx_session(engines["torch"], x)
        if run is not None:
            calls["onnxruntime"] = partial(run, x)
            diff = float(np.abs(run(x) - engines["torch"].forward(x, 0)).max())
            rows.setdefault("onnxruntime_max_abs_diff", {})[f"batch_{batch}"] = diff
        rows.setdefault("numpy_max_abs_diff", {})[f"batch_{batch}"] = float(
            np.abs(engines["numpy"].forward(x, 0) - engines["torch"].forward(x, 0)).max()
        )
        for name, fn in calls.items():  # interleaved by batch; each engine's reps back to back
            rows.setdefault(name, {})[f"batch_{batch}_ms"] = median_ms(fn, reps)
    return {"block": f"{member.name} block 0 ({cfg.dim} wide, {cfg.num_tokens} tokens)", **rows}


# Decoder widths for `--engine auto`'s choice (numpy for a decoder on the CPU): the shipped lm family's 64,
# and up to issue 40's 768-wide prefill model; heads as those models have them.
DECODER_WIDTHS = ((64, 4, 2), (256, 8, 4), (768, 12, 4))


def decoder_engines(dim: int, heads: int, kv_heads: int) -> dict[str, BlockEngine]:
    """Block 0 of a random decoder `dim` wide, on the torch and the numpy engine."""
    config = {**DECODER, "dim": dim, "heads": heads, "kv_heads": kv_heads}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        torch.manual_seed(0)
        (path / "tokenizer.json").write_text("{}")
        save_model(DecoderLM(LMConfig(**config)).eval(), path, Lineage(source="scratch"))  # type: ignore[arg-type]
        manifest = read_any_manifest(path)
        return {name: load_engine(path, 0, manifest, name, "cpu") for name in ("torch", "numpy")}


def decode_figures(reps: int, dim: int = 768, heads: int = 12, kv_heads: int = 4, context: int = 32) -> dict[str, Any]:
    """Per engine: a prefill of `context` tokens into an empty cache, and one decode step after them."""
    engines = decoder_engines(dim, heads, kv_heads)
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((1, context, dim), dtype=np.float32)
    step = rng.standard_normal((1, 1, dim), dtype=np.float32)
    figures: dict[str, Any] = {"block": f"decoder {dim} wide, {heads} query / {kv_heads} key-value heads"}
    for name, engine in engines.items():

        def prefill(e: BlockEngine = engine) -> object:
            return e.decode(prompt, [e.new_cache()])

        cache = engine.new_cache()
        engine.decode(prompt, [cache])

        def one_step(e: BlockEngine = engine, c: Any = cache) -> object:
            out = e.decode(step, [c])
            c.truncate(context)  # the same step again: the cache stays at `context` tokens
            return out

        figures[name] = {f"prefill_{context}_ms": median_ms(prefill, reps), "step_ms": median_ms(one_step, reps)}
    return figures


def decode_by_width(reps: int) -> list[dict[str, Any]]:
    """One-token steps after 100 tokens, and 100-token prefills, at each of DECODER_WIDTHS: numpy over torch."""
    rows = []
    for dim, heads, kv_heads in DECODER_WIDTHS:
        figures = decode_figures(reps, dim, heads, kv_heads, context=100)
        torch_ms, numpy_ms = figures["torch"], figures["numpy"]
        rows.append(
            {
                **figures,
                "dim": dim,
                "step_numpy_over_torch": round(numpy_ms["step_ms"] / torch_ms["step_ms"], 3),
                "prefill_numpy_over_torch": round(numpy_ms["prefill_100_ms"] / torch_ms["prefill_100_ms"], 3),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m layerswarm.bench.engines", description=__doc__)
    parser.add_argument("--reps", type=int, default=50, help="calls per figure (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if any(os.environ.get(name) != "1" for name in BLAS_THREADS):
        # A node gives numpy's BLAS its --threads (1) before numpy loads (cli/node.py); here numpy is
        # loaded already, so run again with the same: two BLAS threads beside torch's one distort numpy's figures.
        env = {**os.environ, **dict.fromkeys(BLAS_THREADS, "1")}
        os.execve(sys.executable, [sys.executable, "-m", "layerswarm.bench.engines", *sys.argv[1:]], env)
    torch.set_num_threads(1)
    report = {
        "environment": environment(),
        "imports": {name: import_cost(module) for name, module in RUNTIMES.items()},
        "forward": forward_figures(args.reps),
        "decode": decode_figures(args.reps),
        "decode_by_width": decode_by_width(args.reps),
    }
    return emit_report(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
