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

from ..kvcache import INITIAL_CAPACITY, GrowingKVCache


class KVCache(GrowingKVCache[Tensor]):
    """One stream at one block, in torch buffers of the keys' own dtype and device."""

    def _empty(self) -> Tensor:
        return torch.empty(self.kv_heads, 0, self.head_dim)

    def _allocate(self, shape: tuple[int, int, int], like: Tensor) -> Tensor:
        return like.new_empty(shape)


class BatchKVCache:
    """The keys and values of B streams at one block in one buffer, (B, kv_heads, capacity, head_dim), each
    row with its own length: the same contents as B KVCaches, written and read without a loop over rows.
    What generation over many prompts at once uses (evaluation), and a node could batch streams in."""

    def __init__(self, rows: int, kv_heads: int, head_dim: int) -> None:
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self._keys: Tensor | None = None
        self._values: Tensor | None = None

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def keys(self) -> Tensor:
        """(B, kv_heads, longest row, head_dim); a row's slots past its length hold nothing meaningful."""
        return self._view(self._keys)

    @property
    def values(self) -> Tensor:
        return self._view(self._values)

    def _view(self, buffer: Tensor | None) -> Tensor:
        span = int(self.lengths.max()) if len(self) else 0
        if buffer is None:
            return torch.empty(len(self), self.kv_heads, 0, self.head_dim)
        return buffer[:, :, :span]

    @property
    def nbytes(self) -> int:
        if self._keys is None or self._values is None:
            return 0
        return self._keys.nbytes + self._values.nbytes

    def append(self, keys: Tensor, values: Tensor, new_tokens: Tensor) -> None:
        """Row b's first new_tokens[b] of keys/values (B, kv_heads, T, head_dim) after its own length."""
        b, _, t, _ = keys.shape
        if b != len(self) or keys.shape != values.shape or keys.shape[1] != self.kv_heads:
            raise ValueError(f"keys {tuple(keys.shape)} do not fit a batch cache of {len(self)} rows")
        slots = self.lengths[:, None] + torch.arange(t)  # (B, T) where each new token goes
        real = torch.arange(t)[None, :] < new_tokens[:, None].cpu()
        self._reserve(int((self.lengths + new_tokens.cpu()).max()), keys)
        assert self._keys is not None and self._values is not None
        rows = torch.arange(b)[:, None].expand(b, t)[real]
        self._keys[rows, :, slots[real]] = keys.transpose(1, 2)[real]  # (N, kv_heads, head_dim)
        self._values[rows, :, slots[real]] = values.transpose(1, 2)[real]
        self.lengths = self.lengths + new_tokens.cpu()

    def truncate(self, lengths: Tensor) -> None:
        """Keep each row's first lengths[b] tokens."""
        if bool((lengths < 0).any()) or bool((lengths > self.lengths).any()):
            raise ValueError(f"cannot truncate rows of {self.lengths.tolist()} to {lengths.tolist()}")
        self.lengths = lengths.clone()

    def _reserve(self, needed: int, like: Tensor) -> None:
        capacity = 0 if self._keys is None else self._keys.shape[2]
        if self._keys is not None and needed <= capacity:
            return
        grown = max(INITIAL_CAPACITY, capacity)
        while grown < needed:
            grown *= 2
        shape = (len(self), self.kv_heads, grown, self.head_dim)
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if self._keys is not None and self._values is not None:
            keys[:, :, :capacity] = self._keys
            values[:, :, :capacity] = self._values
        self._keys, self._values = keys, values
