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
