"""How activations travel (WireFormat), and `--wire-dtype auto`: int8 on links where the bytes it saves
outweigh its codec time, fp16 elsewhere.

An activation of fp16 size B crosses a link in `rtt / 2 + B x ms_per_mb` (membership/linkmap.py);
int8 sends about half the bytes (one byte a value and a 4-byte scale a token), so it saves
`ms_per_mb x (B - B_int8)` per link and costs one quantise at the sender and one dequantise at the
receiver. That codec time is measured once at start on this machine, for the family's activation
shape, as milliseconds per megabyte of fp16 data, so the rule does not depend on the batch size:

    int8  iff  mean ms_per_mb over the path's measured links x (B - B_int8) / B  >  MARGIN x codec_ms_per_mb

Star hops cross coordinator -> node -> coordinator; a relay chain its own links. A link no activation
crossed yet counts as unknown: with no measured link at all the answer is fp16 (the cheap default on
loopback, where the health probe's RTT takes the fixed cost out and the per-byte part is small).
The node's codec time is assumed equal to the coordinator's (a slower edge device makes int8 a little
less worth it than predicted; MARGIN covers part of that).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from layerswarm.wire import codec

MARGIN = 1.5  # int8 must save this many times its codec cost: no flapping at the break-even point
FP16, INT8 = torch.float16, torch.int8


def wire_bytes(numel: int, dim: int, dtype: torch.dtype) -> int:
    """Payload bytes of an activation with `numel` values and rows of `dim` values."""
    if dtype is INT8:
        return numel + 4 * (numel // dim)
    return numel * torch.empty(0, dtype=dtype).element_size()


def measure_codec_ms_per_mb(tokens: int, dim: int, reps: int = 15) -> float:
    """Quantise and dequantise one (1, tokens, dim) activation as the wire does (encode + decode), per
    megabyte of its fp16 size; the median of `reps` after a warm-up."""
    x = torch.randn(1, tokens, dim)
    spec = codec.TensorSpec((None, tokens, dim))
    codec.decode(codec.encode(x, INT8), spec)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        codec.decode(codec.encode(x, INT8), spec)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times) / (wire_bytes(x.numel(), dim, FP16) / 1e6)


@dataclass(frozen=True)
class WireChoice:
    codec_ms_per_mb: float  # measured: measure_codec_ms_per_mb
    dim: int

    def choose(self, links_ms_per_mb: list[float | None], numel: int) -> torch.dtype:
        """int8 or fp16 for an activation of `numel` values crossing these links."""
        measured = [v for v in links_ms_per_mb if v is not None]
        if not measured:
            return FP16
        fp16, int8 = wire_bytes(numel, self.dim, FP16), wire_bytes(numel, self.dim, INT8)
        saved_per_mb = statistics.fmean(measured) * (fp16 - int8) / fp16
        return INT8 if saved_per_mb > MARGIN * self.codec_ms_per_mb else FP16


@dataclass(frozen=True)
class WireFormat:
    """How activations travel, the same for every request (read once from the settings: assembly.py)."""

    dtype: torch.dtype  # the activations' wire dtype (fp16 under --wire-dtype auto: relays, unmeasured links)
    spec: codec.TensorSpec  # what a reply may be: (batch, tokens, dim), bounded batch
    choice: WireChoice | None = None  # --wire-dtype auto: int8 or fp16 per link
    frozen_dtype: torch.dtype | None = None  # text: frozen tokens travel apart in this dtype (None: with the rest)
