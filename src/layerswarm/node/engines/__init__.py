"""Which engine computes a node's block (base.BlockEngine): torch's modules, or numpy's (no torch).

    --engine auto    torch when it is installed, else numpy (a lean install: `pip install layerswarm`)
    --engine torch   torch's modules (models/vit.py, models/lm/model.py), on --device (CPU or CUDA)
    --engine numpy   models/lean/ on the CPU; imports no torch, so a node fits a small board

The torch engine's module is imported only when it is chosen: a node on the numpy engine never loads
torch (tests/node/test_lean_engine.py runs one where `import torch` fails).
"""

from __future__ import annotations

import importlib.util
import os

from layerswarm.models.manifest import AnyManifest

from .base import ENGINES, BlockEngine, EngineCache, EngineError
from .numpy_engine import NumpyEngine

__all__ = ["ENGINES", "BlockEngine", "EngineCache", "EngineError", "choose_engine", "load_engine", "torch_installed"]


def torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder that refuses torch, or a broken install
        return False


def choose_engine(engine: str, device: str) -> str:
    """The engine `--engine` and `--device` settle on, or EngineError naming the flag to change."""
    if engine not in ENGINES:
        raise EngineError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    on_cpu = device in ("auto", "cpu")
    if engine == "auto" and not on_cpu and not torch_installed():
        raise EngineError(
            f"--device {device} needs torch, which is not installed here (pip install 'layerswarm[torch]')"
        )
    if engine == "auto":
        engine = "torch" if torch_installed() else "numpy"
    if engine == "torch" and not torch_installed():
        raise EngineError(
            "--engine torch: torch is not installed here (pip install 'layerswarm[torch]'); "
            "--engine numpy serves the block on the CPU without it"
        )
    if engine == "numpy" and not on_cpu:
        raise EngineError(f"--engine numpy computes on the CPU; --device {device} needs --engine torch (and torch)")
    return engine


def load_engine(
    model_dir: str | os.PathLike[str], index: int, manifest: AnyManifest, engine: str, device: str
) -> BlockEngine:
    """The block, sha256-verified and loaded by the chosen engine."""
    if choose_engine(engine, device) == "numpy":
        return NumpyEngine(model_dir, index, manifest)
    from .torch_engine import TorchEngine  # noqa: PLC0415 - torch only where the torch engine runs

    return TorchEngine(model_dir, index, manifest, device)
