"""Which engine computes a node's block (base.BlockEngine): torch's modules, or numpy's (no torch).

    --engine auto    on the CPU, numpy for a decoder's block (faster per step: below), else torch when it
                     is installed; numpy where torch is not (a lean install: `pip install layerswarm`)
    --engine torch   torch's modules (models/vit.py, models/lm/model.py), on --device (CPU or CUDA)
    --engine numpy   models/lean/ on the CPU; imports no torch, so a node fits a small board

Why numpy for a decoder on the CPU: a generation step is one token through a block, a few dozen small
operations, and torch eager's per-operation cost dominates it. Measured one thread, one-token steps
against a 100-token cache (docs/deploy.md "Engines"): numpy 0.07 against 0.29 ms at 64 wide, 1.75 against
2.44 ms at 768; 128-token prefills within 10% either way. A classifier's block stays on torch where it is
installed (bit-exact with the torch monolith, which the classifier swarm promises).

The torch engine's module is imported only when it is chosen: a node on the numpy engine never loads
torch (tests/node/test_lean_engine.py runs one where `import torch` fails).
"""

from __future__ import annotations

import importlib.util
import os

from layerswarm.models.lm.config import LMConfig
from layerswarm.models.manifest import AnyManifest, ModelDirError, read_any_manifest

from .base import ENGINES, BlockEngine, EngineCache, EngineError
from .numpy_engine import NumpyEngine

__all__ = [
    "ENGINES",
    "BlockEngine",
    "EngineCache",
    "EngineError",
    "choose_engine",
    "is_decoder",
    "load_engine",
    "serves_decoder",
    "torch_installed",
]


def torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder that refuses torch, or a broken install
        return False


def cuda_available() -> bool:
    """Whether torch (installed) sees a CUDA device: imports torch, so asked only where it decides."""
    import torch  # noqa: PLC0415 - only for --device auto on a decoder, where torch is installed

    return bool(torch.cuda.is_available())


def choose_engine(engine: str, device: str, decoder: bool = False) -> str:
    """The engine `--engine` and `--device` settle on for a block (`decoder`: a language model's), or
    EngineError naming the flag to change."""
    if engine not in ENGINES:
        raise EngineError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    on_cpu = device in ("auto", "cpu")
    if engine == "auto" and not on_cpu and not torch_installed():
        raise EngineError(
            f"--device {device} needs torch, which is not installed here (pip install 'layerswarm[torch]')"
        )
    if engine == "auto":
        engine = "torch" if torch_installed() else "numpy"
        if engine == "torch" and decoder and (device == "cpu" or (device == "auto" and not cuda_available())):
            engine = "numpy"  # a decoder's steps on the CPU: numpy is faster (above)
    if engine == "torch" and not torch_installed():
        raise EngineError(
            "--engine torch: torch is not installed here (pip install 'layerswarm[torch]'); "
            "--engine numpy serves the block on the CPU without it"
        )
    if engine == "numpy" and not on_cpu:
        raise EngineError(f"--engine numpy computes on the CPU; --device {device} needs --engine torch (and torch)")
    return engine


def is_decoder(manifest: AnyManifest) -> bool:
    return isinstance(manifest.config, LMConfig)


def serves_decoder(model_dir: str | os.PathLike[str]) -> bool:
    """Whether model_dir holds a language model (False where its manifest cannot be read: the node's
    start, which reads it again, says why)."""
    try:
        return is_decoder(read_any_manifest(model_dir))
    except (ModelDirError, OSError):
        return False


def load_engine(
    model_dir: str | os.PathLike[str], index: int, manifest: AnyManifest, engine: str, device: str
) -> BlockEngine:
    """The block, sha256-verified and loaded by the chosen engine."""
    if choose_engine(engine, device, is_decoder(manifest)) == "numpy":
        return NumpyEngine(model_dir, index, manifest)
    from .torch_engine import TorchEngine  # noqa: PLC0415 - torch only where the torch engine runs

    return TorchEngine(model_dir, index, manifest, device)
