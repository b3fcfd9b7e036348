"""A stream's keys and values at one block: what a node keeps between one token and the next.

    keys, values   (kv_heads, length, head_dim) each: views into buffers grown by doubling
    append         the new tokens' keys and values (prefill: many; decode: one; verify: k + 1)
    truncate(n)    keep the first n tokens (speculative decoding rolls back rejected drafts)

One cache per (stream, block). A node bounds its caches by nbytes (the bytes it allocated, which is what
its memory holds: up to twice what `length` tokens need, after a doubling).
"""

from __future__ import annotations

import torch
from torch import Tensor

INITIAL_CAPACITY = 16  # tokens; the buffers double as the stream grows


class KVCache:
    def __init__(self, kv_heads: int, head_dim: int) -> None:
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.length = 0
        self._keys: Tensor | None = None  # (kv_heads, capacity, head_dim), allocated on the first append
        self._values: Tensor | None = None

    @property
    def keys(self) -> Tensor:
        """(kv_heads, length, head_dim): a view, valid until the next append."""
        return self._view(self._keys)

    @property
    def values(self) -> Tensor:
        return self._view(self._values)

    def _view(self, buffer: Tensor | None) -> Tensor:
        if buffer is None:
            return torch.empty(self.kv_heads, 0, self.head_dim)
        return buffer[:, : self.length]

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds (its allocated buffers, keys and values)."""
        if self._keys is None or self._values is None:
            return 0
        return self._keys.nbytes + self._values.nbytes

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Add n tokens' keys and values, each (kv_heads, n, head_dim), after the ones held."""
        expected = (self.kv_heads, keys.shape[1], self.head_dim)
        if tuple(keys.shape) != expected or keys.shape != values.shape:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)}: expected {expected}")
        n = keys.shape[1]
        self._reserve(self.length + n, keys)
        assert self._keys is not None and self._values is not None
        self._keys[:, self.length : self.length + n] = keys
        self._values[:, self.length : self.length + n] = values
        self.length += n

    def truncate(self, n: int) -> None:
        """Forget every token after the first n (the buffers stay allocated for the tokens that follow)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def capacity_after(self, length: int) -> int:
        """The capacity (tokens) the buffers will have once they hold `length` tokens: what a node books
        before a step, so that its byte bound holds for what the step allocates."""
        if length <= self.capacity:
            return self.capacity
        capacity = max(INITIAL_CAPACITY, self.capacity)
        while capacity < length:
            capacity *= 2
        return capacity

    def _reserve(self, needed: int, like: Tensor) -> None:
        if self._keys is not None and self._values is not None and needed <= self.capacity:
            return
        capacity = self.capacity_after(needed)
        shape = (self.kv_heads, capacity, self.head_dim)
        keys = like.new_empty(shape)
        values = like.new_empty(shape)
        if self._keys is not None and self._values is not None:
            keys[:, : self.length] = self._keys[:, : self.length]
            values[:, : self.length] = self._values[:, : self.length]
        self._keys, self._values = keys, values
