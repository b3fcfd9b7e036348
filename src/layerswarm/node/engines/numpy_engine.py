"""The numpy engine: a block on the CPU without torch (models/lean/), for small devices.

Same weights and checks as the torch engine: the block's file is verified against the manifest's
sha256 before it is read (models/manifest.verified_path), read with safetensors.numpy (never pickle),
and every tensor's name and shape must be exactly what the block's architecture asks (as torch's
load_state_dict(strict=True)). Float32 throughout; a decoder's caches are models/lean/cache.KVCache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from safetensors.numpy import load_file

from layerswarm.models.config import ViTConfig
from layerswarm.models.lean import decoder, vit
from layerswarm.models.lean.cache import KVCache
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.manifest import AnyManifest, ModelDirError, block_file, verified_path

from .base import EngineCache


def load_weights(
    model_dir: str | os.PathLike[str], manifest: AnyManifest, index: int, shapes: dict[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """Block `index`'s tensors, sha256-verified, as float32 arrays of exactly `shapes`."""
    depth = manifest.config.depth
    if not 0 <= index < depth:
        raise ModelDirError(f"block index {index} out of range: {model_dir} has blocks 0..{depth - 1}")
    name = block_file(index)
    path = verified_path(model_dir, manifest, name)
    try:
        tensors = load_file(str(path))
    except (TypeError, ValueError) as exc:  # a dtype numpy lacks (bfloat16 weights): torch reads those
        raise ModelDirError(f"{path}: the numpy engine cannot read it ({exc}); use --engine torch") from exc
    where = f"{model_dir}/{name}"
    missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise ModelDirError(f"{where}: weights do not fit the config (missing {missing}, unexpected {unexpected})")
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise ModelDirError(f"{where}: weights do not fit the config ({key} is {tensors[key].shape}, not {shape})")
    return {key: np.ascontiguousarray(t, dtype=np.float32) for key, t in tensors.items()}


class NumpyEngine:
    name = "numpy"
    device = "cpu"

    def __init__(self, model_dir: str | os.PathLike[str], index: int, manifest: AnyManifest) -> None:
        cfg = manifest.config
        self.block: vit.ViTBlock | decoder.DecoderBlock
        if isinstance(cfg, LMConfig):
            w = load_weights(model_dir, manifest, index, decoder.block_shapes(cfg))
            self.block = decoder.DecoderBlock(cfg, w)
            self.kv_bytes_per_token = 2 * cfg.kv_heads * cfg.head_size * 4
        else:
            assert isinstance(cfg, ViTConfig)
            w = load_weights(model_dir, manifest, index, vit.block_shapes(cfg))
            self.block = vit.ViTBlock(cfg, w)
            self.kv_bytes_per_token = 0
        self.decoder = isinstance(self.block, decoder.DecoderBlock)
        self.nbytes = sum(t.nbytes for t in w.values())

    def forward(self, x: np.ndarray, position: int) -> np.ndarray:
        x = x.astype(np.float32, copy=False)
        if isinstance(self.block, decoder.DecoderBlock):  # a decoder's positions are its tokens'
            return self.block(x)
        return self.block(x, position)

    def forward_tokens(self, x: np.ndarray, position: int, mask: np.ndarray) -> np.ndarray:
        return self._vit().forward_tokens(x.astype(np.float32, copy=False), position, mask)

    def new_cache(self) -> EngineCache:
        return self._decoder().new_cache()

    def decode(self, x: np.ndarray, caches: Sequence[EngineCache]) -> np.ndarray:
        return self._decoder()(x.astype(np.float32, copy=False), _ours(caches))

    def append_kv(self, x: np.ndarray, caches: Sequence[EngineCache]) -> None:
        self._decoder().append_kv(x.astype(np.float32, copy=False), _ours(caches))

    def close(self) -> None:
        pass

    def _vit(self) -> vit.ViTBlock:
        if not isinstance(self.block, vit.ViTBlock):
            raise TypeError("token masks are for text classifiers' blocks")
        return self.block

    def _decoder(self) -> decoder.DecoderBlock:
        if not isinstance(self.block, decoder.DecoderBlock):
            raise TypeError("not a decoder block: no KV caches")
        return self.block


def _ours(caches: Sequence[Any]) -> list[KVCache]:
    """The caches this engine made (new_cache): the stream table hands them back as it got them."""
    return cast(list[KVCache], list(caches))
