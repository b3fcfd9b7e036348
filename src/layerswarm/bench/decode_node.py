"""One decoder node alone (generation): a stream's per-step latency against 16 concurrent streams'
throughput through the same node process, interleaved round by round; and, in this process, what
batching steps of several streams into one block call saves, by number of new tokens (the node's
rule: steps of equal T merge, decode_batch.py).

The block: one Llama-layout decoder block 768 wide (12 heads, 12 key/value heads: GPT-2 small's width),
random weights, streams prefilled with 128 tokens. The node computes on one thread, as a node does.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.nn.functional as F

from layerswarm.harness.procs import Proc, node_address
from layerswarm.models.checkpoint import Lineage, load_block, read_lm_manifest, save_model
from layerswarm.models.lm.cache import KVCache
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.model import DecoderBlock, DecoderLM, apply_rotary, rotary
from layerswarm.models.lm.tokenizer import TOKENIZER_FILE
from layerswarm.wire import codec
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from .fixtures import nodes

BLOCK: dict[str, Any] = {"vocab_size": 512, "dim": 768, "depth": 1, "heads": 12, "kv_heads": 12, "max_seq_len": 1024}
PREFILL = 128
CONCURRENT = 16


def decoder_model_dir(root: Path) -> Path:
    """A one-block decoder of the shape above (time, not accuracy: random weights, and a placeholder
    tokenizer file, which nodes never read)."""
    out = root / "decoder-768-random"
    if not (out / "manifest.json").is_file():
        torch.manual_seed(0)
        out.mkdir(parents=True, exist_ok=True)
        (out / TOKENIZER_FILE).write_text(json.dumps({"note": "benchmark placeholder: random weights"}))
        save_model(DecoderLM(LMConfig(**BLOCK)).eval(), out, Lineage())
    return out


class _Stream:
    """One DecodeStream call (as a coordinator keeps one per node): requests in, replies in order."""

    def __init__(self, stub: pb_grpc.BlockNodeStub) -> None:
        self.queue: asyncio.Queue[pb.DecodeRequest | None] = asyncio.Queue()
        self.call = stub.DecodeStream(self._requests())

    async def _requests(self) -> Any:
        while (item := await self.queue.get()) is not None:
            yield item

    async def round(self, requests: list[pb.DecodeRequest]) -> list[pb.DecodeResponse]:
        for request in requests:
            self.queue.put_nowait(request)
        replies = [await self.call.read() for _ in requests]
        bad = [r.error for r in replies if not isinstance(r, pb.DecodeResponse) or r.refused]
        if bad:
            raise RuntimeError(f"the node refused a step: {bad[0]}")
        return replies

    async def close(self) -> None:
        self.queue.put_nowait(None)
        await self.call.read()


def _step(stream_id: str, start: int, t: int = 1) -> pb.DecodeRequest:
    x = torch.randn(1, t, BLOCK["dim"]).half()  # fp16 on the wire: the coordinator's default
    return pb.DecodeRequest(stream_id=stream_id, start=start, activations=codec.encode(x))


async def node_alone(node: Proc, rounds: int, steps_per_round: int) -> dict[str, Any]:
    """Per round: `steps_per_round` steps of one stream back to back, then as many rounds of all 16
    streams stepping at once (one request each, one DecodeStream): the same number of rounds for each,
    interleaved, so the machine's drift hits both alike."""
    async with grpc.aio.insecure_channel(node_address(node)) as channel:
        stub = pb_grpc.BlockNodeStub(channel)  # type: ignore[no-untyped-call]
        one, many = _Stream(stub), _Stream(stub)
        await one.round([_step("solo", 0, PREFILL)])
        await many.round([_step(f"c{i}", 0, PREFILL) for i in range(CONCURRENT)])
        length = PREFILL
        solo_s: list[float] = []
        solo_compute: list[float] = []
        round_s: list[float] = []
        round_compute: list[float] = []
        batched: list[int] = []
        for _ in range(rounds):
            for _ in range(steps_per_round):
                started = time.perf_counter()
                (reply,) = await one.round([_step("solo", length)])
                solo_s.append(time.perf_counter() - started)
                solo_compute.append(reply.compute_ms)
                started = time.perf_counter()
                replies = await many.round([_step(f"c{i}", length) for i in range(CONCURRENT)])
                round_s.append(time.perf_counter() - started)
                batched += [r.batched for r in replies]
                round_compute.append(sum({r.compute_ms for r in replies}))  # its block calls (one ms each)
                length += 1
        await one.close()
        await many.close()
    solo_tps = 1 / statistics.median(solo_s)
    many_tps = CONCURRENT / statistics.median(round_s)
    return {
        "block": BLOCK,
        "prefill_tokens": PREFILL,
        "steps": len(solo_s),
        "one_stream_step_ms": round(statistics.median(solo_s) * 1e3, 3),
        "one_stream_compute_ms": round(statistics.median(solo_compute), 3),
        "one_stream_tokens_per_s": round(solo_tps, 1),
        "concurrent_streams": CONCURRENT,
        "concurrent_round_ms": round(statistics.median(round_s) * 1e3, 3),
        "concurrent_round_compute_ms": round(statistics.median(round_compute), 3),
        "concurrent_tokens_per_s": round(many_tps, 1),
        "throughput_ratio": round(many_tps / solo_tps, 2),
        "mean_batched": round(statistics.fmean(batched), 2),
    }


def _caches(block: DecoderBlock, lengths: list[int]) -> list[KVCache]:
    caches = [block.new_cache() for _ in lengths]
    with torch.inference_mode():
        for cache, n in zip(caches, lengths, strict=True):
            block(torch.randn(1, n, BLOCK["dim"]), caches=[cache])
    return caches


Call = tuple[list[int], int, list[int] | None]  # rows, T, real new tokens per row (None: all T)


def _timed(block: DecoderBlock, caches: list[KVCache], calls: list[Call]) -> float:
    """Seconds for the block calls given as (rows, T, new tokens per row or None), caches rolled back after."""
    held = [c.length for c in caches]
    started = time.perf_counter()
    with torch.inference_mode():
        for rows, t, new in calls:
            x = torch.randn(len(rows), t, BLOCK["dim"])
            block(x, caches=[caches[r] for r in rows], new_tokens=torch.tensor(new) if new else None)
    elapsed = time.perf_counter() - started
    for cache, n in zip(caches, held, strict=True):
        cache.truncate(n)
    return elapsed


@torch.inference_mode()
def padded_step(block: DecoderBlock, x: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
    """The block as it attended before (models/lm/model.py: _attend_cached): every row's cache copied into
    one zero-padded (B, KV, S, hs) tensor and one masked attention over it. Kept here to time against."""
    a = block.self_attn
    b, t, _ = x.shape
    positions = torch.tensor([c.length for c in caches])[:, None] + torch.arange(t)
    h = block.input_layernorm(x)
    q = a.q_proj(h).view(b, t, a.heads, a.head_size).transpose(1, 2)
    cos, sin = rotary(positions, a.head_size, a.rope_theta)
    q = apply_rotary(q, cos, sin)
    k, v = a.keys_values(h, cos, sin)
    for row, cache in enumerate(caches):
        cache.append(k[row], v[row])
    totals = [c.length for c in caches]
    keys = k.new_zeros(b, a.kv_heads, max(totals), a.head_size)
    values = torch.zeros_like(keys)
    for row, cache in enumerate(caches):
        keys[row, :, : totals[row]] = cache.keys
        values[row, :, : totals[row]] = cache.values
    slots = torch.arange(max(totals))
    mask = (slots[None, None, :] <= positions[:, :, None]) & (
        slots[None, None, :] < torch.tensor(totals)[:, None, None]
    )
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)
    h = x + a.o_proj(out.transpose(1, 2).reshape(b, t, a.heads * a.head_size))
    result: torch.Tensor = h + block.mlp(block.post_attention_layernorm(h))
    return result


def _timed_padded(block: DecoderBlock, caches: list[KVCache]) -> float:
    held = [c.length for c in caches]
    started = time.perf_counter()
    padded_step(block, torch.randn(len(caches), 1, BLOCK["dim"]), caches)
    elapsed = time.perf_counter() - started
    for cache, n in zip(caches, held, strict=True):
        cache.truncate(n)
    return elapsed


def _same_output(block: DecoderBlock, lengths: list[int]) -> float:
    """Max abs difference between the block's step and padded_step's on the same caches (both timed
    versions compute the same thing)."""
    x = torch.randn(len(lengths), 1, BLOCK["dim"])
    torch.manual_seed(5)
    one = _caches(block, lengths)
    torch.manual_seed(5)
    two = _caches(block, lengths)
    with torch.inference_mode():
        return float((block(x, caches=one) - padded_step(block, x, two)).abs().max())


def batching_rule(model_dir: Path, reps: int) -> list[dict[str, Any]]:
    """The block's compute (one thread, this process) for 8 streams of different lengths: each step its
    own call against one call for all, by T; mixed T (steps of 1 with verifies of 4, or with a prefill) as
    a call per T (the node's rule) against one call padded to the longest T; and 16 streams' decode step
    with attention row by row (the block) against one padded attention (padded_step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block = load_block(model_dir, 0, read_lm_manifest(model_dir))
        lengths = [PREFILL + 17 * i for i in range(8)]
        caches = _caches(block, lengths)
        sixteen = _caches(block, [PREFILL + 9 * i for i in range(16)])
        rows = list(range(8))
        cases: dict[str, list[Call]] = {
            "T=1: alone": [([r], 1, None) for r in rows],
            "T=1: one call": [(rows, 1, None)],
            "T=4: alone": [([r], 4, None) for r in rows],
            "T=4: one call": [(rows, 4, None)],
            "T=1 x4 + T=4 x4: a call per T": [(rows[:4], 1, None), (rows[4:], 4, None)],
            "T=1 x4 + T=4 x4: one call padded": [(rows, 4, [1, 1, 1, 1, 4, 4, 4, 4])],
            "T=1 x7 + a T=64 prefill: a call per T": [(rows[:7], 1, None), (rows[7:], 64, None)],
            "T=1 x7 + a T=64 prefill: one call padded": [(rows, 64, [1] * 7 + [64])],
        }
        samples: dict[str, list[float]] = {name: [] for name in cases}
        row_by_row, padded = "16 streams, T=1: one call (attention row by row)", "16 streams, T=1: one padded attention"
        samples[row_by_row], samples[padded] = [], []
        for _ in range(reps):
            for name, calls in cases.items():  # interleaved
                samples[name].append(_timed(block, caches, calls))
            samples[row_by_row].append(_timed(block, sixteen, [(list(range(16)), 1, None)]))
            samples[padded].append(_timed_padded(block, sixteen))
        diff = _same_output(block, [PREFILL + 9 * i for i in range(16)])
    finally:
        torch.set_num_threads(threads)
    rows_out = [{"case": name, "ms": round(statistics.median(s) * 1e3, 3)} for name, s in samples.items()]
    rows_out[-1]["max_abs_diff_vs_row_by_row"] = diff
    return rows_out


def run(root: Path, quick: bool) -> dict[str, Any]:
    model_dir = decoder_model_dir(root)
    with nodes([(model_dir, 0)]) as procs:
        alone = asyncio.run(node_alone(procs[0], 4 if quick else 10, 8 if quick else 16))
    return {**alone, "batching_rule": batching_rule(model_dir, 5 if quick else 20)}
