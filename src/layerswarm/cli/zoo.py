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
                # a language model's figure is its exact match on the generated tasks
                "sequential": m.metrics.get("test_sequential", m.metrics.get("test_sequential_em")),
                "arbitrary_order": m.metrics.get("test_arbitrary", m.metrics.get("test_arbitrary_em")),
            }
        )
    if args.json:
        print("\n".join(json.dumps(r) for r in rows))
        return 0
    print(render(rows))
    return 0


# Four decimals, as docs/models.md's tables; the arbitrary-order figure is one draw of orders, where
# `layerswarm eval` (the docs' tables) averages ten: the footer says so, so the two are not mistaken.
FOOTER = (
    "seq, arb: test accuracy recorded when the model was trained, in order and in one draw of random orders; "
    "`layerswarm eval` averages 10 orders (docs/models.md)"
)


def render(rows: list[dict[str, Any]]) -> str:
    """The table, each column as wide as its widest cell."""
    cells = [["name", "variant", "model id", "family id", "data", "seq", "arb"]]
    for r in rows:
        seq, arb = (f"{v:.4f}" if isinstance(v, float) else "-" for v in (r["sequential"], r["arbitrary_order"]))
        cells.append([r["name"], r["variant"], r["model_id"], r["family_id"], r["data"] or "-", seq, arb])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(c.rjust(w) if i >= 5 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    return "\n".join([*lines, "", FOOTER])
