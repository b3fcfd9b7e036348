"""A stream's keys and values at one block, whatever holds the numbers: the growth and bookkeeping rules
that the torch cache (lm/cache.py) and the torch-free one (lean/cache.py) share, so a node books the same
bytes for a stream whichever engine serves it.

    keys, values   (kv_heads, length, head_dim) each: views into buffers grown by doubling
    append         the new tokens' keys and values (prefill: many; decode: one; verify: k + 1)
    truncate(n)    keep the first n tokens (speculative decoding rolls back rejected drafts)

A subclass says how to make an empty view and a new buffer; nothing here imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, Protocol, TypeVar

INITIAL_CAPACITY = 16  # tokens; the buffers double as the stream grows


class Array(Protocol):
    """What the cache needs of a torch tensor or a numpy array."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...

    def __getitem__(self, key: Any) -> Any: ...

    def __setitem__(self, key: Any, value: Any) -> None: ...


A = TypeVar("A", bound=Array)


class GrowingKVCache(ABC, Generic[A]):
    def __init__(self, kv_heads: int, head_dim: int) -> None:
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.length = 0
        self._keys: A | None = None  # (kv_heads, capacity, head_dim), allocated on the first append
        self._values: A | None = None

    @abstractmethod
    def _empty(self) -> A:
        """(kv_heads, 0, head_dim): what a cache with no buffers yet reads as."""

    @abstractmethod
    def _allocate(self, shape: tuple[int, int, int], like: A) -> A:
        """A new, uninitialised buffer of `shape`, of `like`'s dtype and device."""

    @property
    def keys(self) -> A:
        """(kv_heads, length, head_dim): a view, valid until the next append."""
        return self._view(self._keys)

    @property
    def values(self) -> A:
        return self._view(self._values)

    def _view(self, buffer: A | None) -> A:
        if buffer is None:
            return self._empty()
        view: A = buffer[:, : self.length]
        return view

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds (its allocated buffers, keys and values)."""
        if self._keys is None or self._values is None:
            return 0
        return self._keys.nbytes + self._values.nbytes

    def append(self, keys: A, values: A) -> None:
        """Add n tokens' keys and values, each (kv_heads, n, head_dim), after the ones held."""
        expected = (self.kv_heads, keys.shape[1], self.head_dim)
        if tuple(keys.shape) != expected or tuple(keys.shape) != tuple(values.shape):
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

    def _reserve(self, needed: int, like: A) -> None:
        if self._keys is not None and self._values is not None and needed <= self.capacity:
            return
        shape = (self.kv_heads, self.capacity_after(needed), self.head_dim)
        keys, values = self._allocate(shape, like), self._allocate(shape, like)
        if self._keys is not None and self._values is not None:
            keys[:, : self.length] = self._keys[:, : self.length]
            values[:, : self.length] = self._values[:, : self.length]
        self._keys, self._values = keys, values
