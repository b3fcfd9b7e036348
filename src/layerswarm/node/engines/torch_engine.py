"""The torch engine: the block as models/ builds it (torch modules), on the CPU or a GPU.

What the trainer, the coordinator's spot checks and CUDA devices use. Arrays cross the seam as numpy
(torch.from_numpy, no copy on the CPU) and come back as numpy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from layerswarm.models.checkpoint import AnyManifest, load_block
from layerswarm.models.lm.cache import KVCache
from layerswarm.models.lm.model import DecoderBlock
from layerswarm.models.text.tokens import run_active
from layerswarm.models.vit import Block

from .base import EngineCache, EngineError


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"--device {name}: CUDA is not available on this machine")
    return device


class TorchEngine:
    name = "torch"

    def __init__(self, model_dir: str | os.PathLike[str], index: int, manifest: AnyManifest, device: str) -> None:
        self.torch_device = pick_device(device)
        self.device = str(self.torch_device)
        self.block: Block | DecoderBlock = load_block(model_dir, index, manifest).to(self.torch_device)
        self.decoder = isinstance(self.block, DecoderBlock)
        self.nbytes = sum(p.numel() * p.element_size() for p in self.block.parameters())
        cfg = manifest.config
        self.kv_bytes_per_token = 2 * cfg.kv_heads * cfg.head_size * 4 if self.decoder else 0  # type: ignore[union-attr]

    def _in(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.torch_device, torch.float32)

    @torch.inference_mode()
    def forward(self, x: np.ndarray, position: int) -> np.ndarray:
        t = self._in(x)
        out = self.block(t) if self.decoder else self.block(t, position)  # a decoder's positions are its tokens'
        return out.cpu().numpy()

    @torch.inference_mode()
    def forward_tokens(self, x: np.ndarray, position: int, mask: np.ndarray) -> np.ndarray:
        if not isinstance(self.block, Block):
            raise TypeError("token masks are for text classifiers' blocks")
        out = run_active(self.block, self._in(x), position, torch.from_numpy(mask).to(self.torch_device))
        return out.cpu().numpy()

    def new_cache(self) -> EngineCache:
        return self._decoder().new_cache()

    @torch.inference_mode()
    def decode(self, x: np.ndarray, caches: Sequence[EngineCache]) -> np.ndarray:
        return self._decoder()(self._in(x), caches=_ours(caches)).cpu().numpy()

    @torch.inference_mode()
    def append_kv(self, x: np.ndarray, caches: Sequence[EngineCache]) -> None:
        self._decoder().append_kv(self._in(x), _ours(caches))

    def close(self) -> None:
        pass

    def _decoder(self) -> DecoderBlock:
        if not isinstance(self.block, DecoderBlock):
            raise TypeError("not a decoder block: no KV caches")
        return self.block


def _ours(caches: Sequence[Any]) -> list[KVCache]:
    """The caches this engine made (new_cache): the stream table hands them back as it got them."""
    return cast(list[KVCache], list(caches))
