"""A stream's keys and values at one block, in numpy: models/kvcache.py's rules, float32 buffers."""

from __future__ import annotations

import numpy as np

from ..kvcache import GrowingKVCache


class KVCache(GrowingKVCache[np.ndarray]):
    def _empty(self) -> np.ndarray:
        return np.empty((self.kv_heads, 0, self.head_dim), dtype=np.float32)

    def _allocate(self, shape: tuple[int, int, int], like: np.ndarray) -> np.ndarray:
        return np.empty(shape, dtype=np.float32)
