"""What one process per block costs with no network at all: a ring of block processes over pipes.

A swarm's request runs each block in its own node process, which sits idle while the others compute;
the bound it is held to (bench/edgelan.py) is one process running every block back to back. Here the
same blocks, loaded from the same safetensors, pass the activation around a ring of processes over
pipes: no gRPC, no codec, no checks. Each process times its block twice on the same input: once when
the activation arrives (as a node does) and once more at once, back to back. Interleaved with the
monolith's loop over the same blocks in this process, rep by rep.
"""

from __future__ import annotations

import multiprocessing
import statistics
import struct
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from layerswarm.models.checkpoint import load_block, load_model


def _timed(block: torch.nn.Module, x: torch.Tensor, position: int) -> tuple[torch.Tensor, float]:
    with torch.inference_mode():
        started = time.perf_counter()
        out = block(x, position)
        return out, (time.perf_counter() - started) * 1e3


def _block_process(model_dir: str, index: int, shape: tuple[int, ...], inbox: Connection, outbox: Connection) -> None:
    """One ring member: raw float32 bytes in, the block's output out, each hop's two timings appended."""
    torch.set_num_threads(1)  # as a node does (--threads 1)
    block = load_block(model_dir, index).eval()
    while True:
        message = inbox.recv_bytes()
        if not message:
            outbox.send_bytes(b"")  # pass the stop on
            return
        (count,) = struct.unpack_from("!I", message)
        timings = message[4 : 4 + 16 * count]
        x = torch.frombuffer(bytearray(message[4 + 16 * count :]), dtype=torch.float32).reshape(shape)
        out, first = _timed(block, x, index)
        _, again = _timed(block, x, index)
        header = struct.pack("!I", count + 1) + timings + struct.pack("!dd", first, again)
        outbox.send_bytes(header + out.numpy().tobytes())


def run(model_dir: Path, reps: int) -> dict[str, Any]:
    """Medians over `reps` rounds (after two warm-up rounds) of the blocks' summed compute time."""
    torch.set_num_threads(1)
    model, _ = load_model(model_dir)
    depth = len(model.blocks)
    shape = (1, model.cfg.num_tokens, model.cfg.dim)  # batch 1
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(depth + 1)]  # (reader, writer); ring member i reads pipe i
    procs = [
        ctx.Process(target=_block_process, args=(str(model_dir), i, shape, pipes[i][0], pipes[i + 1][1]), daemon=True)
        for i in range(depth)
    ]
    for proc in procs:
        proc.start()
    samples: dict[str, list[float]] = {"monolith": [], "ring_first": [], "ring_again": []}
    x = torch.rand(shape)
    try:
        for rep in range(reps + 2):
            with torch.inference_mode():
                monolith = 0.0
                y = x
                for i, block in enumerate(model.blocks):
                    y, ms = _timed(block, y, i)
                    monolith += ms
            pipes[0][1].send_bytes(struct.pack("!I", 0) + x.numpy().tobytes())
            reply = pipes[depth][0].recv_bytes()
            pairs = [struct.unpack_from("!dd", reply, 4 + 16 * i) for i in range(depth)]
            ring_out = torch.frombuffer(bytearray(reply[4 + 16 * depth :]), dtype=torch.float32).reshape(shape)
            if not torch.equal(ring_out, y):  # the same blocks from the same files, one thread each
                raise RuntimeError("the ring's output differs from the monolith's: not the same computation")
            if rep >= 2:
                samples["monolith"].append(monolith)
                samples["ring_first"].append(sum(first for first, _ in pairs))
                samples["ring_again"].append(sum(again for _, again in pairs))
    finally:
        pipes[0][1].send_bytes(b"")
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "blocks": depth,
        "reps": reps,
        "monolith_blocks_ms": round(medians["monolith"], 3),
        "ring_first_ms": round(medians["ring_first"], 3),
        "ring_again_ms": round(medians["ring_again"], 3),
        "ring_first_over_monolith": round(medians["ring_first"] / medians["monolith"], 3),
        "ring_again_over_monolith": round(medians["ring_again"] / medians["monolith"], 3),
    }
