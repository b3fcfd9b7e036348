"""The verifier's first layer and the hard bound every reply passes: activation ranges, no compute.

- hard: past half the wire dtype's limit the next hop (a residual block adds to its input) would
  overflow, so such a reply convicts its sender, verification on or off;
- soft: outside the per-position statistics `layerswarm eval` recorded in the manifest (x STATS_MARGIN):
  an odd upload can look odd too, so this only forces re-execution of the hop.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from layerswarm.models import policy
from layerswarm.models.checkpoint import Manifest
from layerswarm.wire import codec

from ..membership.records import Evidence

STATS_MARGIN = 4.0  # the range filter's slack over what evaluation saw (soft violations only)


class PositionRange(TypedDict):
    """What evaluation saw at one position of the path (the manifest's activation statistics)."""

    max_abs: float
    rms_min: float
    rms_max: float


def hard_range_problem(out: torch.Tensor, position: int, wire: torch.dtype) -> Evidence | None:
    """Values past half the wire dtype's limit: the next hop (a residual block adds to its input) would
    overflow. Checked on every reply, verification on or off, so the sender is blamed, not the next hop."""
    peak = codec.peak_abs(out) if out.numel() else 0.0
    limit = codec.value_limit(wire) / 2
    if peak <= limit:
        return None
    return {
        "check": "hard range",
        "against": f"half the {str(wire).removeprefix('torch.')} limit ({limit:.6g}): the next hop would overflow",
        "discrepancy": f"max |x| {peak:.6g}",
        "position": position,
    }


def range_problem(ranges: list[PositionRange], out: torch.Tensor, position: int) -> Evidence | None:
    """A reply outside what evaluation saw at this position (x STATS_MARGIN): soft, forces re-execution."""
    if position >= len(ranges):
        return None
    r = ranges[position]
    peak = codec.peak_abs(out) if out.numel() else 0.0
    rms = out.float().pow(2).mean(dim=tuple(range(1, out.dim()))).sqrt()
    lo, hi = float(rms.min()), float(rms.max())
    if peak > r["max_abs"] * STATS_MARGIN or lo < r["rms_min"] / STATS_MARGIN or hi > r["rms_max"] * STATS_MARGIN:
        return {
            "check": "activation statistics",
            "against": f"evaluation at position {position}: max |x| {r['max_abs']}, "
            f"RMS {r['rms_min']}..{r['rms_max']} (x{STATS_MARGIN:g} margin)",
            "discrepancy": f"max |x| {peak:.4g}, RMS {lo:.4g}..{hi:.4g}",
            "position": position,
        }
    return None


def position_ranges(manifests: list[Manifest]) -> list[PositionRange]:
    """The widest per-position range over the coordinator's own manifests ([] when none recorded)."""
    found = [e["positions"] for m in manifests if (e := policy.entry(m, policy.ACTIVATION_STATS))]
    if not found:
        return []
    depth = min(len(p) for p in found)
    return [
        {
            "max_abs": max(p[i]["max_abs"] for p in found),
            "rms_min": min(p[i]["rms_min"] for p in found),
            "rms_max": max(p[i]["rms_max"] for p in found),
        }
        for i in range(depth)
    ]
