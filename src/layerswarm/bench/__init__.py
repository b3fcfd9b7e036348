"""layerswarm's benchmark suite: `layerswarm bench [--quick] [--json FILE]` (see bench/README.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit_report(report: dict[str, Any], path: Path | None) -> int:
    """A benchmark script's ending: its JSON report printed, and written to `path` (--json) if given."""
    text = json.dumps(report, indent=2)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)
    return 0


def emit_table(report: dict[str, Any], table: str, json_path: Path | None, markdown_path: Path | None) -> int:
    """A benchmark script's ending when it renders a table: the JSON to `json_path` (--json), the table
    to `markdown_path` (--markdown) if given, and the table printed."""
    for path, text in ((json_path, json.dumps(report, indent=2)), (markdown_path, table)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
    print(table)
    return 0
