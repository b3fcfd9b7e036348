"""`layerswarm zoo`: the shipped models, by the name --model-dir accepts."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .base import Subparsers, add_command


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "zoo",
        run,
        help="list the shipped models (zoo:FAMILY/MEMBER names for --model-dir)",
        description="The models shipped with layerswarm: name, variant, model and family ids, and the test "
        "accuracy recorded when they were trained.",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")


def run(args: argparse.Namespace) -> int:
    from layerswarm.models.checkpoint import read_any_manifest
    from layerswarm.models.zoo import resolve, shipped_names

    rows: list[dict[str, Any]] = []
    for name in shipped_names():
        m = read_any_manifest(resolve(name))
        rows.append(
            {
                "name": name,
                "variant": m.variant,
                "model_id": m.model_id,
                "family_id": m.family_id,
                "data": m.dataset.get("spec"),
                "sequential": m.metrics.get("test_sequential"),
                "arbitrary_order": m.metrics.get("test_arbitrary"),
            }
        )
    if args.json:
        print("\n".join(json.dumps(r) for r in rows))
        return 0
    print(f"{'name':<30} {'variant':<14} {'model id':<18} {'family id':<18} {'data':<8} {'seq':>6} {'arb':>6}")
    for r in rows:
        seq, arb = (f"{v:.3f}" if isinstance(v, float) else "-" for v in (r["sequential"], r["arbitrary_order"]))
        print(
            f"{r['name']:<30} {r['variant']:<14} {r['model_id'][:16]:<18} {r['family_id'][:16]:<18} "
            f"{r['data'] or '-':<8} {seq:>6} {arb:>6}"
        )
    return 0
