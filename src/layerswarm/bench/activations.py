"""What compact forms do to real activations: int8's numerical error, and whether zlib pays on fp16.

Every activation a hop would carry (the stem's output and each block's) is captured from a real
forward pass, sent through the codec as int8 and compared with the float32 original; its fp16 bytes
are compressed with zlib, and the time to compress and decompress is set against the time the saved
bytes take on a link: zlib pays on a link only if it saves more transfer time than it costs.
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

import torch

from layerswarm.models.checkpoint import load_model
from layerswarm.wire import codec

LINKS_MBIT = (100, 1000)


def activations(model_dir: Path, images: torch.Tensor) -> list[torch.Tensor]:
    """The stem's output and every block's, in order, as float32 (what hops carry)."""
    model, _ = load_model(model_dir)
    model.eval()
    with torch.inference_mode():
        x = model.stem(images)
        out = [x]
        for position, block in enumerate(model.blocks):
            x = block(x, position)
            out.append(x)
    return out


def int8_error(acts: list[torch.Tensor]) -> dict[str, Any]:
    """Relative RMS error of int8 over all hops, its worst hop, and the worst element against its row's peak."""
    rel_rms, worst_step, codec_s = [], 0.0, 0.0
    for x in acts:
        started = time.perf_counter()
        y = codec.decode(codec.encode(x, torch.int8))
        codec_s += time.perf_counter() - started
        rel_rms.append(float((y - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()))
        peak = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        worst_step = max(worst_step, float(((y - x).abs() / peak).max()))
    return {
        "int8_rel_rms_mean": round(sum(rel_rms) / len(rel_rms), 5),
        "int8_rel_rms_worst_hop": round(max(rel_rms), 5),
        "int8_worst_error_over_row_peak": round(worst_step, 5),  # a half step is 1/254 = 0.00394
        "int8_codec_ms_per_hop": round(codec_s / len(acts) * 1e3, 3),  # quantise + dequantise
    }


def zlib_pays(acts: list[torch.Tensor], level: int = 1) -> dict[str, Any]:
    """fp16 bytes through zlib: the ratio, the codec time, and the net saving per hop on each link."""
    raw = [codec.encode(x, torch.float16).data for x in acts]
    started = time.perf_counter()
    packed = [zlib.compress(b, level) for b in raw]
    compress_s = time.perf_counter() - started
    started = time.perf_counter()
    for p in packed:
        zlib.decompress(p)
    decompress_s = time.perf_counter() - started
    raw_bytes, packed_bytes = sum(map(len, raw)), sum(map(len, packed))
    cpu_ms_per_hop = (compress_s + decompress_s) / len(raw) * 1e3
    row: dict[str, Any] = {
        "zlib_level": level,
        "fp16_bytes_per_hop": raw_bytes // len(raw),
        "zlib_ratio": round(raw_bytes / packed_bytes, 4),
        "zlib_cpu_ms_per_hop": round(cpu_ms_per_hop, 3),
    }
    for mbit in LINKS_MBIT:
        saved_ms = (raw_bytes - packed_bytes) / len(raw) * 8 / (mbit * 1e6) * 1e3
        row[f"net_saving_ms_per_hop_{mbit}mbit"] = round(saved_ms - cpu_ms_per_hop, 3)
    return row


def accuracy_by_wire(model_dir: Path, images: torch.Tensor, labels: torch.Tensor) -> list[dict[str, Any]]:
    """Accuracy when every hop's activation travels as each wire dtype (the swarm's rounding, in one
    process): in the trained order and in random orders (one per image batch, the same for every dtype)."""
    model, _ = load_model(model_dir)
    model.eval()
    depth = len(model.blocks)
    rng = torch.Generator().manual_seed(0)
    batches = range(0, len(labels), 100)
    orders = {"sequential": [list(range(depth))] * len(batches)}
    orders["random order"] = [torch.randperm(depth, generator=rng).tolist() for _ in batches]
    rows: list[dict[str, Any]] = []
    for order_kind, per_batch in orders.items():
        for wire in ("fp32", "fp16", "int8"):
            dtype, correct = codec.dtype_by_name(wire), 0
            with torch.inference_mode():
                for start, order in zip(batches, per_batch, strict=True):
                    x = codec.as_sent(model.stem(images[start : start + 100]), dtype)
                    for position, index in enumerate(order):
                        x = codec.as_sent(model.blocks[index](x, position), dtype)
                    predicted = model.head(x).argmax(-1)
                    correct += int((predicted == labels[start : start + 100]).sum())
            rows.append({"order": order_kind, "wire_dtype": wire, "accuracy": round(correct / len(labels), 4)})
    for row in rows:
        base = next(r for r in rows if r["order"] == row["order"] and r["wire_dtype"] == "fp32")
        row["points_lost"] = round((base["accuracy"] - row["accuracy"]) * 100, 2)
        row["images"] = len(labels)
    return rows


def measure(model_dir: Path, images: torch.Tensor, label: str) -> dict[str, Any]:
    acts = activations(model_dir, images)
    return {
        "model": label,
        "activation_shape": list(acts[0].shape),
        "hops": len(acts),
        **int8_error(acts),
        **zlib_pays(acts),
    }
