"""The machine a benchmark ran on, and when: every report's `environment` (the figures are ratios measured
in one run; this says which run and where)."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc
import torch

from layerswarm import __version__


def environment() -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cores": _cores(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "layerswarm": __version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cores() -> int:
    return len(os.sched_getaffinity(0))
